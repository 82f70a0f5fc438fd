#include "manifest.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>

namespace hpcdl {
namespace {

constexpr size_t kMaxRecord = 1u << 16;  // two paths of at most PATH_MAX, with room to spare
constexpr size_t kFields = 10;

bool parse_u64(const std::string& s, uint64_t* out) {
  if (s.empty() || s.size() > 20 || s.find_first_not_of("0123456789") != std::string::npos) {
    return false;
  }
  errno = 0;
  *out = std::strtoull(s.c_str(), nullptr, 10);
  return errno == 0;
}

}  // namespace

FileIdentity identity_of(const struct stat& st) {
  auto ns = [](const struct timespec& t) {
    return static_cast<uint64_t>(t.tv_sec) * 1000000000ULL + static_cast<uint64_t>(t.tv_nsec);
  };
  return FileIdentity{static_cast<uint64_t>(st.st_size), ns(st.st_mtim), ns(st.st_ctim),
                      static_cast<uint64_t>(st.st_ino), static_cast<uint64_t>(st.st_dev)};
}

std::string encode_record(const ManifestRecord& r) {
  std::string payload(1, r.kind);
  for (const std::string* s : {&r.dest, &r.source}) {
    payload.push_back('\0');
    payload += *s;
  }
  for (uint64_t v : {r.source_id.size, r.source_id.mtime_ns, r.source_id.ctime_ns,
                     r.source_id.ino, r.source_id.dev, r.copy_ino, r.copy_dev}) {
    payload.push_back('\0');
    payload += std::to_string(v);
  }
  return "R1 " + std::to_string(payload.size()) + "\n" + payload;
}

size_t decode_records(const std::string& data, std::vector<ManifestRecord>* out) {
  size_t pos = 0;
  while (pos < data.size()) {
    if (data.compare(pos, 3, "R1 ") != 0) return pos;
    const size_t nl = data.find('\n', pos + 3);
    uint64_t len = 0;
    if (nl == std::string::npos || !parse_u64(data.substr(pos + 3, nl - pos - 3), &len) ||
        len > kMaxRecord || data.size() - (nl + 1) < len) {
      return pos;
    }
    const std::string payload = data.substr(nl + 1, len);
    std::vector<std::string> f;
    size_t start = 0;
    for (;;) {
      const size_t z = payload.find('\0', start);
      f.push_back(payload.substr(start, z == std::string::npos ? std::string::npos : z - start));
      if (z == std::string::npos) break;
      start = z + 1;
    }
    ManifestRecord r;
    uint64_t v[7] = {};
    bool ok = f.size() == kFields && f[0].size() == 1 && (f[0][0] == 'f' || f[0][0] == 'd');
    for (size_t i = 0; ok && i < 7; ++i) ok = parse_u64(f[3 + i], &v[i]);
    if (!ok) return pos;
    r.kind = f[0][0];
    r.dest = f[1];
    r.source = f[2];
    r.source_id = FileIdentity{v[0], v[1], v[2], v[3], v[4]};
    r.copy_ino = v[5];
    r.copy_dev = v[6];
    out->push_back(std::move(r));
    pos = nl + 1 + len;
  }
  return pos;
}

Manifest::Manifest(const std::string& path) : path_(path) {
  fd_ = UniqueFd(::open(path.c_str(), O_RDWR | O_CREAT | O_APPEND | O_NOFOLLOW | O_CLOEXEC, 0600));
  if (!fd_.valid()) {
    int err = errno;
    throw StageError("cannot open manifest " + path + ": " + errno_text(err) +
                         "; the stager does not start and training reads from the PFS",
                     err);
  }
  std::lock_guard<std::mutex> lock(mu_);
  refresh_locked();
}

int Manifest::append(const ManifestRecord& r) {
  const std::string bytes = encode_record(r);
  std::lock_guard<std::mutex> lock(mu_);
  for (;;) {
    const ssize_t n = ::write(fd_.get(), bytes.data(), bytes.size());
    if (n == static_cast<ssize_t>(bytes.size())) break;
    if (n < 0 && errno == EINTR) continue;
    return n < 0 ? errno : EIO;  // a short append leaves a torn tail that readers ignore
  }
  return 0;  // indexed by the next refresh, with the other stagers' records
}

uint64_t Manifest::path_hash(const std::string& path) {
  Fnv1a64 h;
  h.update(path.data(), path.size());
  return h.digest();
}

std::optional<Manifest::Match> Manifest::find(const std::string& dest, uint64_t ino,
                                              uint64_t dev) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t key = path_hash(dest);
  for (int pass = 0; pass < 2; ++pass) {
    const auto [first, last] = by_dest_.equal_range(key);
    for (auto it = first; it != last; ++it) {
      if (it->second.copy_ino == ino && it->second.copy_dev == dev) return it->second.match;
    }
    if (pass == 0) refresh_locked();
  }
  return std::nullopt;
}

void Manifest::index(const ManifestRecord& r) {
  // The newest record of a (dest, inode) wins: inode numbers are reused after an eviction.
  Known known{r.copy_ino, r.copy_dev, Match{path_hash(r.source), r.source_id}};
  const auto [first, last] = by_dest_.equal_range(path_hash(r.dest));
  for (auto it = first; it != last; ++it) {
    if (it->second.copy_ino == r.copy_ino && it->second.copy_dev == r.copy_dev) {
      it->second = known;
      return;
    }
  }
  by_dest_.emplace(path_hash(r.dest), known);
}

void Manifest::refresh_locked() {
  // Read on from the first byte not yet parsed (our own appends and other stagers' alike), in
  // 4 MiB chunks: a manifest of 1.28 M records is never held whole, as bytes or as records.
  constexpr size_t kChunk = 4u << 20;
  std::string data;
  std::vector<ManifestRecord> records;
  for (;;) {
    struct stat st {};
    if (::fstat(fd_.get(), &st) != 0 || static_cast<uint64_t>(st.st_size) <= consumed_) return;
    const uint64_t want = std::min<uint64_t>(st.st_size - consumed_, kChunk + kMaxRecord + 64);
    data.assign(static_cast<size_t>(want), '\0');
    ssize_t got = ::pread(fd_.get(), data.data(), data.size(), static_cast<off_t>(consumed_));
    if (got <= 0) return;
    data.resize(static_cast<size_t>(got));
    records.clear();
    const size_t used = decode_records(data, &records);
    for (const auto& r : records) index(r);
    consumed_ += used;
    if (used == 0) return;  // a torn or malformed tail: wait for more, read no further
  }
}

}  // namespace hpcdl
