#include "plan.h"

#include <arpa/inet.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <unordered_map>
#include <fstream>
#include <algorithm>
#include <utility>

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

// A plan file read in 1 MiB chunks, line by line: the whole text of 1.28 M entries (140 MB) is
// never held. The hash covers every byte of the file, as the status map reports it.
class LineReader {
 public:
  explicit LineReader(std::ifstream& in) : in_(in), chunk_(1u << 20) {}

  const std::string& line() const { return line_; }  // the current line, without its '\n'
  size_t lineno() const { return lineno_; }          // its number, from 1

  // The next line into line(); false at the end of the file.
  bool next() {
    for (;;) {
      const size_t nl = pending_.find('\n', pos_);
      if (nl != std::string::npos || (eof_ && pos_ < pending_.size())) {
        const size_t stop = nl == std::string::npos ? pending_.size() : nl;
        line_.assign(pending_, pos_, stop - pos_);
        pos_ = stop + (nl == std::string::npos ? 0 : 1);
        ++lineno_;
        return true;
      }
      if (eof_) return false;
      refill();
    }
  }

  // Reads to the end of the file and returns the hash of all its bytes.
  uint64_t finish() {
    while (!eof_) refill();
    return hash_.digest();
  }

 private:
  void refill() {
    pending_.erase(0, pos_);
    pos_ = 0;
    in_.read(chunk_.data(), static_cast<std::streamsize>(chunk_.size()));
    const auto got = static_cast<size_t>(in_.gcount());
    if (got == 0) {
      eof_ = true;
      return;
    }
    hash_.update(chunk_.data(), got);
    pending_.append(chunk_.data(), got);
  }

  std::ifstream& in_;
  Fnv1a64 hash_;
  std::vector<char> chunk_;
  std::string pending_, line_;
  size_t pos_ = 0, lineno_ = 0;
  bool eof_ = false;
};

// Each entry's index by its file id.
std::unordered_map<uint64_t, size_t> entries_by_file(const Plan& plan) {
  std::unordered_map<uint64_t, size_t> entry_of_file;
  for (size_t i = 0; i < plan.entries.size(); ++i) entry_of_file[plan.entries[i].file_id] = i;
  return entry_of_file;
}

// The optional peer section, from its "peers <P>" line (already in `line`) up to the line
// before "end": P lines "<node>\t<ipv4>:<port>", then "peer_sources <S>" and S lines
// "<file id>\t<node>\t<ready tick>". Every file id must be a plan entry, every node a peer.
void read_peer_section(Plan& plan, const std::string& path, LineReader& lines) {
  const std::string& line = lines.line();
  uint64_t count = 0;
  const auto head = split(line, ' ');
  if (head.size() != 2 || !parse_u64(head[1], &count) || count > 65536) {
    fail(path, lines.lineno(), "bad peers line '" + line.substr(0, 60) + "'");
  }
  std::unordered_map<uint64_t, int32_t> peer_of_node;
  for (uint64_t k = 0; k < count; ++k) {
    if (!lines.next()) fail(path, lines.lineno(), "truncated peer list");
    const auto f = split(line, '\t');
    const size_t colon = f.size() == 2 ? f[1].rfind(':') : std::string::npos;
    PeerAddress peer;
    uint64_t node = 0, port = 0;
    struct in_addr addr {};
    if (colon == std::string::npos || !parse_u64(f[0], &node) || node > UINT32_MAX ||
        !parse_u64(f[1].substr(colon + 1), &port) || port == 0 || port > 65535 ||
        ::inet_pton(AF_INET, f[1].substr(0, colon).c_str(), &addr) != 1 ||
        peer_of_node.count(node)) {
      fail(path, lines.lineno(), "bad peer line '" + line.substr(0, 60) + "' (want <node>\\t<ipv4>:<port>)");
    }
    peer.node = static_cast<uint32_t>(node);
    peer.host = f[1].substr(0, colon);
    peer.port = static_cast<uint16_t>(port);
    peer_of_node[node] = static_cast<int32_t>(plan.peers.size());
    plan.peers.push_back(peer);
  }
  uint64_t sources = 0;
  if (!lines.next() || split(line, ' ').size() != 2 || split(line, ' ')[0] != "peer_sources" ||
      !parse_u64(split(line, ' ')[1], &sources) || sources > plan.entries.size()) {
    fail(path, lines.lineno(), "expected 'peer_sources <n>' with n at most the entries");
  }
  const auto entry_of_file = entries_by_file(plan);
  plan.peer_sources.assign(plan.entries.size(), PeerSource{});
  for (uint64_t k = 0; k < sources; ++k) {
    if (!lines.next()) fail(path, lines.lineno(), "truncated peer sources");
    const auto f = split(line, '\t');
    uint64_t file_id = 0, node = 0, ready = 0;
    if (f.size() != 3 || !parse_u64(f[0], &file_id) || !parse_u64(f[1], &node) ||
        !parse_u64(f[2], &ready) || ready > UINT32_MAX) {
      fail(path, lines.lineno(), "bad peer source '" + line.substr(0, 60) + "'");
    }
    const auto entry = entry_of_file.find(file_id);
    const auto peer = peer_of_node.find(node);
    if (entry == entry_of_file.end() || peer == peer_of_node.end()) {
      fail(path, lines.lineno(), "peer source for a file or node the plan does not list");
    }
    plan.peer_sources[entry->second] = PeerSource{peer->second, static_cast<uint32_t>(ready)};
  }
}

// One line of the pieces section, "<slot id>\t<shard file id>\t<shard size>\t<offset>", into
// plan.pieces; `shard_size` holds each shard's size as its first piece line said it. Returns the
// shard's id.
uint64_t read_piece_line(Plan& plan, const std::string& path, const LineReader& lines,
                     const std::unordered_map<uint64_t, size_t>& entry_of_file,
                     std::unordered_map<uint64_t, uint64_t>& shard_size) {
  const std::string& line = lines.line();
  const size_t lineno = lines.lineno();
  const auto f = split(line, '\t');
  uint64_t slot = 0, shard = 0, size = 0, offset = 0;
  if (f.size() != 4 || !parse_u64(f[0], &slot) || !parse_u64(f[1], &shard) ||
      !parse_u64(f[2], &size) || !parse_u64(f[3], &offset) || shard >= plan.dataset_files ||
      size > kMaxFileSize) {
    fail(path, lineno, "bad piece line '" + line.substr(0, 60) +
                           "' (want <slot id>\\t<shard file id>\\t<shard size>\\t<offset>)");
  }
  const auto entry = entry_of_file.find(slot);
  if (entry == entry_of_file.end()) {
    fail(path, lineno, "piece " + f[0] + " is not an entry of the plan");
  }
  PieceSource& piece = plan.pieces[entry->second];
  if (piece.piece) fail(path, lineno, "piece " + f[0] + " listed twice");
  const uint64_t length = plan.entries[entry->second].size;
  if (offset > size || length > size - offset) {
    fail(path, lineno, "piece " + f[0] + " (" + std::to_string(length) + " bytes at offset " +
                           f[3] + ") ends past its shard's " + f[2] + " bytes");
  }
  if (shard_size.emplace(shard, size).first->second != size) {
    fail(path, lineno, "shard " + f[1] + " has another size on an earlier piece line");
  }
  piece = PieceSource{offset, size, static_cast<uint32_t>(shard), true};
  return shard;
}

// The optional pieces section, from its "pieces <K>" line (already in `line`): K piece lines.
// A shard is no piece itself, and where the plan lists it whole its size is the entry's.
void read_piece_section(Plan& plan, const std::string& path, LineReader& lines) {
  const std::string& line = lines.line();
  uint64_t count = 0;
  const auto head = split(line, ' ');
  if (head.size() != 2 || !parse_u64(head[1], &count) || count > plan.entries.size()) {
    fail(path, lines.lineno(), "expected 'pieces <n>' with n at most the entries, got '" +
                                   line.substr(0, 60) + "'");
  }
  const auto entry_of_file = entries_by_file(plan);
  std::unordered_map<uint64_t, uint64_t> shard_size;
  std::vector<std::pair<uint64_t, size_t>> shard_lines;  // (shard id, line), checked at the end
  plan.pieces.assign(plan.entries.size(), PieceSource{});
  for (uint64_t k = 0; k < count; ++k) {
    if (!lines.next()) fail(path, lines.lineno(), "truncated pieces section");
    const uint64_t shard = read_piece_line(plan, path, lines, entry_of_file, shard_size);
    shard_lines.emplace_back(shard, lines.lineno());
  }
  for (const auto& [shard, lineno] : shard_lines) {
    const auto whole = entry_of_file.find(shard);
    if (whole == entry_of_file.end()) continue;
    if (plan.pieces[whole->second].piece) {
      fail(path, lineno, "shard " + std::to_string(shard) + " is itself a piece");
    }
    if (plan.entries[whole->second].size != shard_size[shard]) {
      fail(path, lineno, "shard " + std::to_string(shard) + "'s size differs from its entry's");
    }
  }
}

// The header, from "hpcdl-plan <version>" up to its "entries <n>" line: returns n.
uint64_t read_header(Plan& plan, const std::string& path, LineReader& lines) {
  const std::string& line = lines.line();
  if (!lines.next() || line != "hpcdl-plan " + std::to_string(kPlanVersion)) {
    fail(path, 1, "expected header 'hpcdl-plan " + std::to_string(kPlanVersion) + "', got '" +
                      line.substr(0, 40) + "'");
  }
  plan.version = kPlanVersion;
  uint64_t expected_entries = 0;
  bool seen_entries = false;
  while (!seen_entries && lines.next()) {
    const auto kv = split(line, ' ');
    if (kv.empty()) fail(path, lines.lineno(), "empty header line");
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
        fail(path, lines.lineno(), "dataset_files must be at most " +
                                       std::to_string(kMaxDatasetFiles) + ", got '" +
                                       line.substr(0, 60) + "'");
      }
    } else if (key == "entries" && kv.size() == 2) {
      ok = parse_u64(kv[1], &expected_entries) && expected_entries <= plan.dataset_files;
      if (!ok) {
        fail(path, lines.lineno(), "entries must be at most dataset_files (" +
                                       std::to_string(plan.dataset_files) + "), got '" +
                                       line.substr(0, 60) + "'");
      }
      seen_entries = true;
    } else if (key != "node" && key != "shuffle") {  // those two are informational
      fail(path, lines.lineno(), "unknown or malformed header line '" + line.substr(0, 60) + "'");
    }
    if (!ok) fail(path, lines.lineno(), "bad value in '" + line.substr(0, 60) + "'");
  }
  if (!seen_entries) fail(path, lines.lineno(), "missing 'entries' line");
  if (plan.local_ranks == 0) fail(path, lines.lineno(), "missing 'local_ranks'");
  return expected_entries;
}

// One entry line "<file id>\t<size>\t<steps>\t<dest>\t<source>" (steps comma-separated,
// ascending); `steps` is scratch space.
void read_entry(Plan& plan, const std::string& path, const LineReader& lines,
                uint64_t expected_entries, std::vector<uint32_t>& steps) {
  const size_t lineno = lines.lineno();
  const auto f = split(lines.line(), '\t');
  if (f.size() != 5) fail(path, lineno, "expected 5 tab-separated fields");
  uint64_t file_id = 0, size = 0;
  if (!parse_u64(f[0], &file_id) || file_id >= plan.dataset_files) {
    fail(path, lineno, "bad file id '" + f[0] + "'");
  }
  if (!parse_u64(f[1], &size) || size > kMaxFileSize) fail(path, lineno, "bad size '" + f[1] + "'");
  steps.clear();
  if (!f[2].empty()) {
    for (const auto& t : split(f[2], ',')) {
      uint64_t v = 0;
      if (!parse_u64(t, &v) || v > UINT32_MAX) fail(path, lineno, "bad step '" + t + "'");
      if (!steps.empty() && v <= steps.back()) fail(path, lineno, "steps not ascending");
      steps.push_back(static_cast<uint32_t>(v));
    }
  }
  std::string why;
  if (!is_safe_relative(f[3], &why)) fail(path, lineno, "rejected: " + why);
  if (f[4].empty()) fail(path, lineno, "empty source path");
  if (plan.entries.size() >= expected_entries) {
    fail(path, lineno, "more entries than the 'entries' line declares");
  }
  plan.add(file_id, size, f[3], f[4], steps);
}

// The entry lines and the optional peer and pieces sections (in that order), up to "end":
// whether "end" was there.
bool read_entries(Plan& plan, const std::string& path, LineReader& lines,
                  uint64_t expected_entries) {
  std::vector<uint32_t> steps;
  const std::string& line = lines.line();
  auto starts = [&](const char* word) { return line.compare(0, std::strlen(word), word) == 0; };
  while (lines.next()) {
    if (line == "end") return true;
    if (starts("peers ") || starts("pieces ")) {
      if (plan.entries.size() != expected_entries) {
        fail(path, lines.lineno(), split(line, ' ')[0] + " before all entries");
      }
      bool more = true;
      if (starts("peers ")) {
        read_peer_section(plan, path, lines);
        more = lines.next();
      }
      if (more && starts("pieces ")) {
        read_piece_section(plan, path, lines);
        more = lines.next();
      }
      if (!more || line != "end") {
        fail(path, lines.lineno(), "expected 'end' after the peer and pieces sections");
      }
      return true;
    }
    read_entry(plan, path, lines, expected_entries, steps);
  }
  return false;
}

// Each file once: sorted ids instead of a hash set (16 bytes an entry, freed at once).
void check_each_file_once(const Plan& plan, const std::string& path, size_t first_entry_line) {
  std::vector<std::pair<uint32_t, uint32_t>> ids(plan.entries.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    ids[i] = {plan.entries[i].file_id, static_cast<uint32_t>(i)};
  }
  std::sort(ids.begin(), ids.end());
  for (size_t i = 1; i < ids.size(); ++i) {
    if (ids[i].first == ids[i - 1].first) {
      fail(path, first_entry_line + std::max(ids[i].second, ids[i - 1].second),
           "file id " + std::to_string(ids[i].first) + " listed twice");
    }
  }
}

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

void Plan::add(uint64_t file_id, uint64_t size, const std::string& dest,
               const std::string& source, const std::vector<uint32_t>& step_list) {
  // The longest tail of source, starting after a '/', that dest ends with: the data set's
  // relative path, so the prefix is its root ("/pfs/imagenet/train/") for every entry.
  size_t shared = 0;
  for (size_t k = 1; k <= std::min(dest.size(), source.size()); ++k) {
    if (dest[dest.size() - k] != source[source.size() - k]) break;
    if (k < source.size() && source[source.size() - k - 1] == '/') shared = k;
  }
  const std::string prefix = source.substr(0, source.size() - shared);
  size_t p = prefixes.size();
  if (!prefixes.empty() && prefixes[last_prefix_] == prefix) {
    p = last_prefix_;
  } else {
    for (size_t i = 0; i < prefixes.size() && i < 64; ++i) {
      if (prefixes[i] == prefix) p = i;
    }
    if (p == prefixes.size()) prefixes.push_back(prefix);
  }
  last_prefix_ = p;
  PlanEntry e;
  e.file_id = static_cast<uint32_t>(file_id);
  e.size = size;
  e.dest = names.size();
  e.ticks = tick_data.size();
  e.tick_count = static_cast<uint32_t>(step_list.size());
  e.source_prefix = static_cast<uint32_t>(p);
  e.source_suffix = static_cast<uint32_t>(dest.size() - shared);
  names.append(dest);
  names.push_back('\0');
  tick_data.insert(tick_data.end(), step_list.begin(), step_list.end());
  entries.push_back(e);
}

Plan read_plan(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    int err = errno;
    throw StageError("cannot open plan " + path + ": " + errno_text(err) +
                         "; the stager cannot start and training reads from the PFS",
                     err);
  }
  LineReader lines(in);
  Plan plan;
  const uint64_t expected_entries = read_header(plan, path, lines);
  const size_t first_entry_line = lines.lineno() + 1;
  const bool seen_end = read_entries(plan, path, lines, expected_entries);
  check_each_file_once(plan, path, first_entry_line);
  if (!seen_end) fail(path, lines.lineno(), "truncated plan (no 'end' line)");
  plan.hash = lines.finish();
  if (plan.entries.size() != expected_entries) {
    fail(path, lines.lineno(),
         "plan says " + std::to_string(expected_entries) + " entries but holds " +
             std::to_string(plan.entries.size()));
  }
  return plan;
}

}  // namespace hpcdl
