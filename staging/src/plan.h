// Reading the node's staging plan (<stage_dir>/.hpcdl/plan, format in docs/staging.md).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace hpcdl {

// One planned file: 40 bytes. Its names and steps live in the Plan's shared buffers (Plan::dest,
// ::source, ::ticks read them), not in a std::string and a std::vector per file: ImageNet-1k's
// 1.28 M entries took 395 MB as separate allocations.
struct PlanEntry {
  uint64_t size = 0;             // bytes, as the planner saw it
  uint64_t dest = 0;             // offset in Plan::names of the destination, NUL-terminated
  uint64_t ticks = 0;            // offset in Plan::tick_data of the steps that read the file
  uint32_t file_id = 0;          // index into the data set's file list (status map slot)
  uint32_t tick_count = 0;
  uint32_t source_prefix = 0;    // the source is prefixes[source_prefix] + dest[source_suffix:]
  uint32_t source_suffix = 0;
};

// Steps of one entry (ascending), a view into Plan::tick_data.
struct TickSpan {
  const uint32_t* first = nullptr;
  const uint32_t* last = nullptr;
  const uint32_t* begin() const { return first; }
  const uint32_t* end() const { return last; }
  size_t size() const { return static_cast<size_t>(last - first); }
  bool empty() const { return first == last; }
};

// A node this stager may fetch from (the plan's optional peer section, docs/staging.md).
struct PeerAddress {
  uint32_t node = 0;     // the peer's node index (for messages)
  std::string host;      // IPv4 address, dotted
  uint16_t port = 0;
};

// Where one entry comes from: peer index into Plan::peers (-1: the PFS), and the plan step from
// which the fetch may start (the home's first read of the file).
struct PeerSource {
  int32_t peer = -1;
  uint32_t ready_tick = 0;
};

// A piece entry's bytes (the plan's optional pieces section, docs/staging.md): bytes
// [offset, offset + the entry's size) of the shard file `shard_id` (its id in the home's plan and
// the status map), which is `shard_size` bytes. The entry's source is the shard's PFS path.
struct PieceSource {
  uint64_t offset = 0;
  uint64_t shard_size = 0;
  uint32_t shard_id = 0;
  bool piece = false;  // false: the entry is a whole file
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
  std::string names;             // every entry's destination, each NUL-terminated
  std::vector<std::string> prefixes;  // distinct source prefixes (one per data set root)
  std::vector<uint32_t> tick_data;
  std::vector<PeerAddress> peers;         // empty: every entry comes from the PFS
  std::vector<PeerSource> peer_sources;   // per entry when peers is not empty, else empty
  std::vector<PieceSource> pieces;        // per entry when the plan lists pieces, else empty

  PeerSource peer_source(size_t entry) const {
    return entry < peer_sources.size() ? peer_sources[entry] : PeerSource{};
  }
  PieceSource piece(size_t entry) const {
    return entry < pieces.size() ? pieces[entry] : PieceSource{};
  }
  bool is_piece(size_t entry) const { return piece(entry).piece; }
  // Makes entry a piece of `from` (an entry carried over from another plan).
  void set_piece(size_t entry, const PieceSource& from) {
    if (pieces.size() < entries.size()) pieces.resize(entries.size());
    pieces[entry] = from;
  }
  std::string dest(const PlanEntry& e) const { return names.c_str() + e.dest; }
  std::string source(const PlanEntry& e) const {
    return prefixes[e.source_prefix] + (names.c_str() + e.dest + e.source_suffix);
  }
  TickSpan ticks(const PlanEntry& e) const {
    const uint32_t* first = tick_data.data() + e.ticks;
    return TickSpan{first, first + e.tick_count};
  }
  // Appends an entry; the source shares its tail with dest where both end alike.
  void add(uint64_t file_id, uint64_t size, const std::string& dest, const std::string& source,
           const std::vector<uint32_t>& ticks);

 private:
  size_t last_prefix_ = 0;
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
