#include "plan.h"

#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <unordered_set>

#include "common.h"

namespace hpcdl {
namespace {

[[noreturn]] void fail(const std::string& path, size_t line, const std::string& what) {
  throw StageError("plan " + path + " line " + std::to_string(line) + ": " + what +
                   "; the stager cannot start and training reads from the PFS");
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> parts;
  size_t start = 0;
  for (;;) {
    size_t pos = s.find(sep, start);
    parts.push_back(s.substr(start, pos == std::string::npos ? std::string::npos : pos - start));
    if (pos == std::string::npos) return parts;
    start = pos + 1;
  }
}

bool parse_u64(const std::string& s, uint64_t* out) {
  if (s.empty() || s.find_first_not_of("0123456789") != std::string::npos) return false;
  errno = 0;
  char* end = nullptr;
  unsigned long long v = std::strtoull(s.c_str(), &end, 10);
  if (errno != 0 || *end != '\0') return false;
  *out = v;
  return true;
}

bool parse_i64(const std::string& s, int64_t* out) {
  if (!s.empty() && s[0] == '-') {
    uint64_t v = 0;
    if (!parse_u64(s.substr(1), &v)) return false;
    *out = -static_cast<int64_t>(v);
    return true;
  }
  uint64_t v = 0;
  if (!parse_u64(s, &v)) return false;
  *out = static_cast<int64_t>(v);
  return true;
}

// Bounds that keep every size computed from a plan far from overflow: the status map holds one
// byte per data set file, cursors are int64 step counts, byte counters sum entry sizes.
constexpr uint64_t kMaxDatasetFiles = 1ull << 32;
constexpr uint64_t kMaxStepsPerEpoch = 1ull << 32;
constexpr int64_t kMaxEpoch = 1ll << 24;
constexpr uint64_t kMaxFileSize = 1ull << 50;

}  // namespace

bool is_safe_relative(const std::string& rel, std::string* why) {
  if (rel.empty()) {
    *why = "empty destination path";
    return false;
  }
  if (rel[0] == '/') {
    *why = "absolute destination path '" + rel + "' (must be relative to the stage dir)";
    return false;
  }
  for (unsigned char c : rel) {
    if (c < 0x20 || c == 0x7f) {
      *why = "control character in destination path '" + rel + "'";
      return false;
    }
  }
  const auto parts = split(rel, '/');
  for (size_t i = 0; i < parts.size(); ++i) {
    const auto& p = parts[i];
    if (p.empty() || p == "." || p == "..") {
      *why = "destination path '" + rel + "' has an empty, '.' or '..' component";
      return false;
    }
    if (i == 0 && p == ".hpcdl") {
      *why = "destination path '" + rel + "' lies inside the stager's own .hpcdl directory";
      return false;
    }
  }
  return true;
}

uint64_t fingerprint_number(const std::string& fingerprint) {
  uint64_t v = 0;
  for (size_t i = 0; i < fingerprint.size() && i < 16; ++i) {
    char c = fingerprint[i];
    int d = (c >= '0' && c <= '9') ? c - '0' : (c >= 'a' && c <= 'f') ? c - 'a' + 10 : -1;
    if (d < 0) return 0;
    v = (v << 4) | static_cast<uint64_t>(d);
  }
  return v;
}

Plan read_plan(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    int err = errno;
    throw StageError("cannot open plan " + path + ": " + errno_text(err) +
                         "; the stager cannot start and training reads from the PFS",
                     err);
  }
  std::stringstream buffer;
  buffer << in.rdbuf();
  const std::string text = buffer.str();

  Plan plan;
  Fnv1a64 hash;
  hash.update(text.data(), text.size());
  plan.hash = hash.digest();

  std::istringstream lines(text);
  std::string line;
  size_t lineno = 0;
  uint64_t expected_entries = 0;
  bool seen_entries = false;
  bool seen_end = false;

  auto next = [&]() -> bool {
    if (!std::getline(lines, line)) return false;
    ++lineno;
    return true;
  };

  if (!next() || line != "hpcdl-plan " + std::to_string(kPlanVersion)) {
    fail(path, 1, "expected header 'hpcdl-plan " + std::to_string(kPlanVersion) + "', got '" +
                      line.substr(0, 40) + "'");
  }
  plan.version = kPlanVersion;
  while (!seen_entries && next()) {
    const auto kv = split(line, ' ');
    if (kv.empty()) fail(path, lineno, "empty header line");
    const std::string& key = kv[0];
    bool ok = true;
    if (key == "fingerprint" && kv.size() == 2) {
      plan.fingerprint = kv[1];
    } else if (key == "seed" && kv.size() == 2) {
      ok = parse_u64(kv[1], &plan.seed);
    } else if (key == "epochs" && kv.size() == 3) {
      ok = parse_i64(kv[1], &plan.epoch_begin) && parse_i64(kv[2], &plan.epoch_end) &&
           plan.epoch_begin >= 0 && plan.epoch_end >= plan.epoch_begin &&
           plan.epoch_end <= kMaxEpoch;
    } else if (key == "steps_per_epoch" && kv.size() == 2) {
      ok = parse_u64(kv[1], &plan.steps_per_epoch) && plan.steps_per_epoch <= kMaxStepsPerEpoch;
    } else if (key == "local_ranks" && kv.size() == 2) {
      uint64_t v = 0;
      ok = parse_u64(kv[1], &v) && v > 0 && v < 65536;
      plan.local_ranks = static_cast<uint32_t>(v);
    } else if (key == "dataset_files" && kv.size() == 2) {
      ok = parse_u64(kv[1], &plan.dataset_files) && plan.dataset_files <= kMaxDatasetFiles;
      if (!ok) {
        fail(path, lineno, "dataset_files must be at most " + std::to_string(kMaxDatasetFiles) +
                               ", got '" + line.substr(0, 60) + "'");
      }
    } else if (key == "entries" && kv.size() == 2) {
      ok = parse_u64(kv[1], &expected_entries) && expected_entries <= plan.dataset_files;
      if (!ok) {
        fail(path, lineno, "entries must be at most dataset_files (" +
                               std::to_string(plan.dataset_files) + "), got '" +
                               line.substr(0, 60) + "'");
      }
      seen_entries = true;
    } else if (key == "node" || key == "shuffle") {
      // informational
    } else {
      fail(path, lineno, "unknown or malformed header line '" + line.substr(0, 60) + "'");
    }
    if (!ok) fail(path, lineno, "bad value in '" + line.substr(0, 60) + "'");
  }
  if (!seen_entries) fail(path, lineno, "missing 'entries' line");
  if (plan.local_ranks == 0) fail(path, lineno, "missing 'local_ranks'");

  std::unordered_set<uint64_t> ids;
  while (next()) {
    if (line == "end") {
      seen_end = true;
      break;
    }
    const auto f = split(line, '\t');
    if (f.size() != 5) fail(path, lineno, "expected 5 tab-separated fields");
    PlanEntry e;
    if (!parse_u64(f[0], &e.file_id) || e.file_id >= plan.dataset_files) {
      fail(path, lineno, "bad file id '" + f[0] + "'");
    }
    if (!ids.insert(e.file_id).second) fail(path, lineno, "file id " + f[0] + " listed twice");
    if (!parse_u64(f[1], &e.size) || e.size > kMaxFileSize) {
      fail(path, lineno, "bad size '" + f[1] + "'");
    }
    if (!f[2].empty()) {
      for (const auto& t : split(f[2], ',')) {
        uint64_t v = 0;
        if (!parse_u64(t, &v) || v > UINT32_MAX) fail(path, lineno, "bad step '" + t + "'");
        if (!e.ticks.empty() && v <= e.ticks.back()) fail(path, lineno, "steps not ascending");
        e.ticks.push_back(static_cast<uint32_t>(v));
      }
    }
    std::string why;
    if (!is_safe_relative(f[3], &why)) fail(path, lineno, "rejected: " + why);
    e.dest = f[3];
    if (f[4].empty()) fail(path, lineno, "empty source path");
    e.source = f[4];
    plan.entries.push_back(std::move(e));
    if (plan.entries.size() > expected_entries) {
      fail(path, lineno, "more entries than the 'entries' line declares");
    }
  }
  if (!seen_end) fail(path, lineno, "truncated plan (no 'end' line)");
  if (plan.entries.size() != expected_entries) {
    fail(path, lineno,
         "plan says " + std::to_string(expected_entries) + " entries but holds " +
             std::to_string(plan.entries.size()));
  }
  return plan;
}

}  // namespace hpcdl
