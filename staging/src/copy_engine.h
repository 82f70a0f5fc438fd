// Copying one file from the PFS into the stage dir: safe directory descent (no symlinks), a
// temporary name and an atomic rename, kernel copy paths with a read/write fallback, optional
// checksum verification, and the emulated PFS (HPCDL_STAGE_EMULATE_PFS).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "common.h"

namespace hpcdl {

// Emulated parallel file system: a latency per source open and an aggregate bandwidth cap on
// source reads, shared by all copy threads of this process. Emulation only, for tests/benchmarks.
class PfsEmulation {
 public:
  // Parses "latency_ms=2,mbps=500" (either key optional); throws StageError on a bad value.
  static PfsEmulation parse(const std::string& spec);
  static PfsEmulation from_env();

  bool active() const { return latency_ms_ > 0 || mbps_ > 0; }
  void on_open() const;              // sleeps the open latency
  void on_read(uint64_t bytes);      // sleeps until the bandwidth cap allows `bytes`
  double latency_ms() const { return latency_ms_; }
  double mbps() const { return mbps_; }

  PfsEmulation() = default;
  PfsEmulation(const PfsEmulation& other) : latency_ms_(other.latency_ms_), mbps_(other.mbps_) {}

 private:
  double latency_ms_ = 0;
  double mbps_ = 0;
  std::mutex mu_;
  std::chrono::steady_clock::time_point next_free_{};
};

// The stage directory, opened once; every destination is reached with openat(O_NOFOLLOW) one
// component at a time, so neither a symlinked directory nor a plan entry can lead outside it.
class StageTree {
 public:
  explicit StageTree(const std::string& root);
  const std::string& root() const { return root_; }

  // Directory fd for `rel_dir` ("" = the root), created with mode 0700 when `create`; -1 when it
  // does not exist and !create. Throws StageError for a symlink or non-directory on the way.
  int dir_for(const std::string& rel_dir, bool create);

 private:
  std::string root_;
  UniqueFd root_fd_;
  std::mutex mu_;
  std::unordered_map<std::string, std::unique_ptr<UniqueFd>> dirs_;
  // Directories seen missing by a lookup without `create` (a fresh stage dir: every reuse
  // check would otherwise cost a failing openat); a creating lookup clears the entry.
  std::unordered_set<std::string> missing_;
};

enum class CopyOutcome { Ok, Transient, Failed, NoSpace, Cancelled };

struct CopyResult {
  CopyOutcome outcome = CopyOutcome::Ok;
  uint64_t bytes = 0;
  std::string message;  // path + strerror + what happens next, when not Ok
};

class CopyEngine {
 public:
  CopyEngine(StageTree& tree, PfsEmulation& pfs, bool verify, const std::atomic<bool>& cancel);

  // Copies `source` to `dest` (relative to the stage dir) through a temporary name; `buffer` is
  // the calling thread's scratch space, `tag` makes its temporary names unique.
  CopyResult copy(const std::string& source, const std::string& dest, std::vector<char>& buffer,
                  unsigned tag);

  // True when `dest` already holds an intact copy of `source`: a regular file of `size` bytes
  // with the source's mtime (and, with --verify, the same checksum).
  bool is_intact(const std::string& source, const std::string& dest, uint64_t size,
                 std::vector<char>& buffer);

  // Removes `dest`; returns 0 or the errno.
  int remove(const std::string& dest);

 private:
  StageTree& tree_;
  PfsEmulation& pfs_;
  bool verify_;
  const std::atomic<bool>& cancel_;
  std::string tmp_suffix_;  // ".hpcdl-tmp.<pid>."
};

// Splits "a/b/c" into ("a/b", "c").
std::pair<std::string, std::string> split_dest(const std::string& dest);

// True for a temporary file name made by CopyEngine (".<name>.hpcdl-tmp.<pid>.<tag>").
bool is_temp_name(const std::string& name);

}  // namespace hpcdl
