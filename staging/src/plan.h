// Reading the node's staging plan (<stage_dir>/.hpcdl/plan, format in docs/staging.md).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace hpcdl {

struct PlanEntry {
  uint64_t file_id = 0;          // index into the data set's file list (status map slot)
  uint64_t size = 0;             // bytes, as the planner saw it
  std::vector<uint32_t> ticks;   // steps (from the plan's first epoch) that read the file, ascending
  std::string dest;              // path relative to the stage dir (validated)
  std::string source;            // path on the parallel file system
};

struct Plan {
  int version = 0;
  std::string fingerprint;       // data set fingerprint (hex)
  uint64_t seed = 0;
  int64_t epoch_begin = 0;       // epochs [epoch_begin, epoch_end)
  int64_t epoch_end = 0;
  uint64_t steps_per_epoch = 0;
  uint32_t local_ranks = 0;
  uint64_t dataset_files = 0;    // status map slots
  uint64_t hash = 0;             // FNV-1a of the plan file's bytes
  std::vector<PlanEntry> entries;  // first-use order
};

constexpr int kPlanVersion = 1;

// Parses and validates a plan; throws StageError naming the path, the line and the problem.
Plan read_plan(const std::string& path);

// True when `rel` is a safe destination: relative, non-empty, no "." / ".." / empty components,
// not inside ".hpcdl", no control characters. `why` receives the reason otherwise.
bool is_safe_relative(const std::string& rel, std::string* why);

// First 16 hex digits of the fingerprint as a number (0 when not hex).
uint64_t fingerprint_number(const std::string& fingerprint);

}  // namespace hpcdl
