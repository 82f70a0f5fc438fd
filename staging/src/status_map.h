// The shared status map (<stage_dir>/.hpcdl/status) and the consumption progress file
// (<stage_dir>/.hpcdl/progress). Byte layouts are documented in docs/staging.md; the Python side
// (hpcdl/staging/status.py) reads the same offsets.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common.h"

namespace hpcdl {

enum class FileState : uint8_t { Pending = 0, Copying = 1, Ready = 2, Failed = 3, Evicted = 4 };
enum class RunState : uint32_t { Starting = 0, Running = 1, Done = 2, Stopped = 3 };

constexpr uint32_t kStatusVersion = 1;
constexpr size_t kStatusHeaderSize = 256;
constexpr uint32_t kFlagNoSpace = 1;       // ENOSPC seen: stopped growing
constexpr uint32_t kFlagCapacityFull = 2;  // capacity reached at least once

// Header field offsets (bytes).
namespace status_offset {
constexpr size_t kVersion = 8, kHeaderSize = 12, kFiles = 16, kPlanHash = 24, kFingerprint = 32,
                 kPid = 40, kHeartbeat = 48, kFilesStaged = 56, kBytesStaged = 64,
                 kFailures = 72, kEvictions = 80, kFilesReused = 88, kBytesResident = 96,
                 kCapacity = 104, kRunState = 112, kFlags = 116, kPlanEntries = 120,
                 kPlanReady = 128, kBytesReused = 136, kPeerFiles = 144, kPeerBytes = 152,
                 kPeerFallbacks = 160, kFilesServed = 168, kBytesServed = 176, kPfsOpens = 184,
                 kPeerConnections = 192;
}  // namespace status_offset

// The layouts of the status map and the progress file as one JSON object (offsets, types, state
// codes): `hpcdl-stage --print-layout`. hpcdl/staging/status.py reads them from there.
std::string layout_json();

class StatusMap {
 public:
  // Maps an existing status file when it matches (files, fingerprint) -- states are kept so a
  // restart can reuse staged files -- else atomically replaces it with a fresh, all-PENDING one.
  static StatusMap open(const std::string& path, uint64_t files, uint64_t fingerprint);

  uint64_t files() const { return files_; }
  FileState state(uint64_t id) const;
  void set_state(uint64_t id, FileState s);

  void store(size_t offset, uint64_t v);
  uint64_t load(size_t offset) const;
  void add(size_t offset, uint64_t v);
  void store32(size_t offset, uint32_t v);
  void set_flag(uint32_t flag);
  void heartbeat();  // CLOCK_REALTIME nanoseconds

 private:
  StatusMap(MappedRegion region, uint64_t files) : region_(std::move(region)), files_(files) {}
  MappedRegion region_;
  uint64_t files_;
};

// How far one local rank has consumed: epoch * steps_per_epoch + steps done in that epoch
// (one aligned 8-byte word, so a reader never sees a torn value); -1 = not started.
struct Cursor {
  int64_t position = -1;
};

class ProgressFile {
 public:
  // Opens the progress file read-only; a missing file means nobody consumes (stage-only run).
  static ProgressFile open(const std::string& path);
  std::vector<Cursor> read() const;

 private:
  explicit ProgressFile(MappedRegion region, uint32_t ranks)
      : region_(std::move(region)), ranks_(ranks) {}
  MappedRegion region_;
  uint32_t ranks_ = 0;
};

}  // namespace hpcdl
