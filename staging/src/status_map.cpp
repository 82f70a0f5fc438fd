#include "status_map.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <time.h>

#include <cstring>

namespace hpcdl {
namespace {

constexpr char kStatusMagic[8] = {'H', 'P', 'C', 'D', 'L', 'S', 'T', 'A'};
constexpr char kProgressMagic[8] = {'H', 'P', 'C', 'D', 'L', 'P', 'R', 'G'};
constexpr uint32_t kProgressVersion = 1;
// Progress header: magic, u32 version at 8, u32 local ranks at 12; then one slot per rank whose
// first 8 bytes are its cursor.
constexpr size_t kProgressHeader = 64, kProgressSlot = 64, kProgressRanksOffset = 12;

MappedRegion map_file(int fd, size_t len, int prot, const std::string& path) {
  void* addr = ::mmap(nullptr, len, prot, MAP_SHARED, fd, 0);
  if (addr == MAP_FAILED) {
    int err = errno;
    throw StageError("cannot mmap " + path + ": " + errno_text(err) +
                         "; the stager stops and training reads from the PFS",
                     err);
  }
  return MappedRegion(addr, len);
}

bool existing_matches(const std::string& path, uint64_t files, uint64_t fingerprint) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
  if (!fd.valid()) return false;
  unsigned char header[kStatusHeaderSize];
  if (::pread(fd.get(), header, sizeof header, 0) != static_cast<ssize_t>(sizeof header)) {
    return false;
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0 ||
      static_cast<uint64_t>(st.st_size) != kStatusHeaderSize + files) {
    return false;
  }
  uint32_t version = 0;
  uint64_t n = 0, fp = 0;
  std::memcpy(&version, header + status_offset::kVersion, 4);
  std::memcpy(&n, header + status_offset::kFiles, 8);
  std::memcpy(&fp, header + status_offset::kFingerprint, 8);
  return std::memcmp(header, kStatusMagic, 8) == 0 && version == kStatusVersion && n == files &&
         fp == fingerprint;
}

void create_fresh(const std::string& path, uint64_t files, uint64_t fingerprint) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  UniqueFd fd(::open(tmp.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600));
  if (!fd.valid()) {
    int err = errno;
    throw StageError("cannot create status map " + tmp + ": " + errno_text(err) +
                         "; the stager stops and training reads from the PFS",
                     err);
  }
  unsigned char header[kStatusHeaderSize] = {};
  std::memcpy(header, kStatusMagic, 8);
  const uint32_t version = kStatusVersion, hsize = kStatusHeaderSize;
  std::memcpy(header + status_offset::kVersion, &version, 4);
  std::memcpy(header + status_offset::kHeaderSize, &hsize, 4);
  std::memcpy(header + status_offset::kFiles, &files, 8);
  std::memcpy(header + status_offset::kFingerprint, &fingerprint, 8);
  // posix_fallocate, not ftruncate: a sparse map on a full file system would fault (SIGBUS)
  // at the first write to an unbacked page instead of failing here with ENOSPC.
  const off_t size = static_cast<off_t>(kStatusHeaderSize + files);
  int err = 0;
  if (::pwrite(fd.get(), header, sizeof header, 0) != static_cast<ssize_t>(sizeof header)) {
    err = errno;
  } else if (int rc = ::posix_fallocate(fd.get(), 0, size); rc != 0) {
    err = rc;  // posix_fallocate returns the error instead of setting errno
  } else if (::rename(tmp.c_str(), path.c_str()) != 0) {
    err = errno;
  }
  if (err != 0) {
    ::unlink(tmp.c_str());
    throw StageError("cannot write status map " + path + ": " + errno_text(err) +
                         "; the stager stops and training reads from the PFS",
                     err);
  }
}

}  // namespace

std::string layout_json() {
  namespace so = status_offset;
  struct Field {
    const char* name;
    size_t offset;
    const char* type;
  };
  const Field fields[] = {
      {"version", so::kVersion, "u32"},         {"header_size", so::kHeaderSize, "u32"},
      {"files", so::kFiles, "u64"},             {"plan_hash", so::kPlanHash, "u64"},
      {"fingerprint", so::kFingerprint, "u64"}, {"pid", so::kPid, "i64"},
      {"heartbeat_ns", so::kHeartbeat, "i64"},  {"files_staged", so::kFilesStaged, "u64"},
      {"bytes_staged", so::kBytesStaged, "u64"}, {"failures", so::kFailures, "u64"},
      {"evictions", so::kEvictions, "u64"},     {"files_reused", so::kFilesReused, "u64"},
      {"bytes_resident", so::kBytesResident, "u64"}, {"capacity", so::kCapacity, "u64"},
      {"run_state", so::kRunState, "u32"},      {"flags", so::kFlags, "u32"},
      {"plan_entries", so::kPlanEntries, "u64"}, {"plan_ready", so::kPlanReady, "u64"},
      {"bytes_reused", so::kBytesReused, "u64"},
      {"peer_files", so::kPeerFiles, "u64"}, {"peer_bytes", so::kPeerBytes, "u64"},
      {"peer_fallbacks", so::kPeerFallbacks, "u64"}, {"files_served", so::kFilesServed, "u64"},
      {"bytes_served", so::kBytesServed, "u64"}, {"pfs_opens", so::kPfsOpens, "u64"},
      {"peer_connections", so::kPeerConnections, "u64"},
  };
  std::string out = "{\"status\": {\"magic\": \"" + std::string(kStatusMagic, 8) +
                    "\", \"version\": " + std::to_string(kStatusVersion) +
                    ", \"header_size\": " + std::to_string(kStatusHeaderSize) + ", \"fields\": {";
  for (size_t i = 0; i < sizeof fields / sizeof fields[0]; ++i) {
    out += std::string(i ? ", " : "") + "\"" + fields[i].name + "\": {\"offset\": " +
           std::to_string(fields[i].offset) + ", \"type\": \"" + fields[i].type + "\"}";
  }
  auto codes = [](std::initializer_list<std::pair<const char*, unsigned>> items) {
    std::string s = "{";
    for (const auto& [name, code] : items) {
      s += std::string(s.size() > 1 ? ", " : "") + "\"" + name + "\": " + std::to_string(code);
    }
    return s + "}";
  };
  using FS = FileState;
  using RS = RunState;
  auto u = [](auto v) { return static_cast<unsigned>(v); };
  out += "}, \"file_states\": " +
         codes({{"PENDING", u(FS::Pending)}, {"COPYING", u(FS::Copying)}, {"READY", u(FS::Ready)},
                {"FAILED", u(FS::Failed)}, {"EVICTED", u(FS::Evicted)}}) +
         ", \"run_states\": " +
         codes({{"STARTING", u(RS::Starting)}, {"RUNNING", u(RS::Running)}, {"DONE", u(RS::Done)},
                {"STOPPED", u(RS::Stopped)}}) +
         ", \"flags\": " +
         codes({{"NOSPACE", kFlagNoSpace}, {"CAPACITY_FULL", kFlagCapacityFull}}) + "}";
  out += ", \"progress\": {\"magic\": \"" + std::string(kProgressMagic, 8) +
         "\", \"version\": " + std::to_string(kProgressVersion) + ", \"header_size\": " +
         std::to_string(kProgressHeader) + ", \"ranks_offset\": " +
         std::to_string(kProgressRanksOffset) + ", \"slot_size\": " +
         std::to_string(kProgressSlot) + "}}";
  return out;
}

StatusMap StatusMap::open(const std::string& path, uint64_t files, uint64_t fingerprint) {
  if (!existing_matches(path, files, fingerprint)) create_fresh(path, files, fingerprint);
  UniqueFd fd(::open(path.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW));
  if (!fd.valid()) {
    int err = errno;
    throw StageError("cannot open status map " + path + ": " + errno_text(err) +
                         "; the stager stops and training reads from the PFS",
                     err);
  }
  return StatusMap(map_file(fd.get(), kStatusHeaderSize + files, PROT_READ | PROT_WRITE, path),
                   files);
}

FileState StatusMap::state(uint64_t id) const {
  return static_cast<FileState>(
      __atomic_load_n(region_.bytes() + kStatusHeaderSize + id, __ATOMIC_ACQUIRE));
}

void StatusMap::set_state(uint64_t id, FileState s) {
  __atomic_store_n(region_.bytes() + kStatusHeaderSize + id, static_cast<uint8_t>(s),
                   __ATOMIC_RELEASE);
}

void StatusMap::store(size_t offset, uint64_t v) {
  __atomic_store_n(reinterpret_cast<uint64_t*>(region_.bytes() + offset), v, __ATOMIC_RELEASE);
}

uint64_t StatusMap::load(size_t offset) const {
  return __atomic_load_n(reinterpret_cast<uint64_t*>(region_.bytes() + offset), __ATOMIC_ACQUIRE);
}

void StatusMap::add(size_t offset, uint64_t v) {
  __atomic_fetch_add(reinterpret_cast<uint64_t*>(region_.bytes() + offset), v, __ATOMIC_ACQ_REL);
}

void StatusMap::store32(size_t offset, uint32_t v) {
  __atomic_store_n(reinterpret_cast<uint32_t*>(region_.bytes() + offset), v, __ATOMIC_RELEASE);
}

void StatusMap::set_flag(uint32_t flag) {
  __atomic_fetch_or(reinterpret_cast<uint32_t*>(region_.bytes() + status_offset::kFlags), flag,
                    __ATOMIC_ACQ_REL);
}

void StatusMap::heartbeat() {
  struct timespec ts {};
  ::clock_gettime(CLOCK_REALTIME, &ts);
  store(status_offset::kHeartbeat,
        static_cast<uint64_t>(ts.tv_sec) * 1000000000ULL + static_cast<uint64_t>(ts.tv_nsec));
}

ProgressFile ProgressFile::open(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
  if (!fd.valid()) return ProgressFile(MappedRegion(), 0);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0 || static_cast<size_t>(st.st_size) < kProgressHeader) {
    return ProgressFile(MappedRegion(), 0);
  }
  MappedRegion region = map_file(fd.get(), static_cast<size_t>(st.st_size), PROT_READ, path);
  uint32_t ranks = 0;
  if (std::memcmp(region.bytes(), kProgressMagic, 8) != 0) {
    throw StageError("progress file " + path +
                     " has a bad magic number; the stager stops and training reads from the PFS");
  }
  std::memcpy(&ranks, region.bytes() + kProgressRanksOffset, 4);
  if (kProgressHeader + static_cast<size_t>(ranks) * kProgressSlot > region.size()) {
    throw StageError("progress file " + path +
                     " is shorter than its rank count; the stager stops and training reads "
                     "from the PFS");
  }
  return ProgressFile(std::move(region), ranks);
}

std::vector<Cursor> ProgressFile::read() const {
  std::vector<Cursor> cursors(ranks_);
  for (uint32_t r = 0; r < ranks_; ++r) {
    auto* slot = reinterpret_cast<int64_t*>(region_.bytes() + kProgressHeader + r * kProgressSlot);
    cursors[r].position = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
  }
  return cursors;
}

}  // namespace hpcdl
