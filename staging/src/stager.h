// The staging process: reads the plan and the consumption cursors, runs the copy threads,
// publishes file states and counters in the status map.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace hpcdl {

struct StagerOptions {
  std::string stage_dir;
  std::string session;          // control files in <stage_dir>/.hpcdl/sessions/<session>/
  unsigned threads = 8;
  std::optional<uint64_t> capacity;  // bytes (0: stage nothing); unset: default_capacity()
  uint32_t window_steps = 0;    // copy at most this many steps ahead of the slowest rank; 0 = no limit
  uint32_t protect_steps = 4;   // never evict a file read within this many steps of the cursor
  bool verify = false;
  bool once = false;            // exit when nothing more can be staged (stage-only runs)
  long parent_pid = 0;          // exit when this process goes away (0 = do not watch)
  bool quiet = false;
  bool peer = false;            // peer tier: the job's secret on stdin (docs/staging.md)
  int peer_listen_fd = -1;      // serve peers on this inherited listening socket (-1: do not)
  unsigned nice = 0;            // added to the niceness it started with (docs/staging.md)
  unsigned nice_later = 0;      // added once the ranks pass the first epoch of its plan
};

// The capacity used without --capacity: free space of `dir`'s file system minus
// max(5 % of its size, 1 GiB); 0 when it cannot be read. The one definition of this default:
// Python asks for it with `hpcdl-stage --default-capacity DIR`.
uint64_t default_capacity(const std::string& dir);

// Runs until SIGTERM/SIGINT, parent death, or (once) nothing left to do. Returns the exit code.
int run_stager(const StagerOptions& options);

}  // namespace hpcdl
