// Which file to copy next (earliest next use not yet local) and which to evict when the stage
// capacity is full (the resident file whose next use is farthest away, never one about to be read).
#pragma once

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "plan.h"

namespace hpcdl {

class NextUseSchedule {
 public:
  static constexpr uint32_t kNever = UINT32_MAX;

  explicit NextUseSchedule(const Plan& plan);

  // First step >= cursor at which entry reads its file, kNever when none.
  uint32_t next_use(size_t entry, uint32_t cursor) const;

  // Moves the scan position to the first use at or after `cursor` (never backwards unless
  // `rewind`): uses behind the slowest rank are no longer worth copying for.
  void seek(uint32_t cursor, bool rewind = false);

  // The next use at the scan position with step < limit whose entry `needs` a copy; uses whose
  // entry needs nothing are passed over for good. Does not consume the returned use.
  template <class Needs>
  std::optional<std::pair<size_t, uint32_t>> peek(uint32_t limit, Needs needs) {
    while (scan_ < events_.size()) {
      const auto [tick, entry] = events_[scan_];
      if (tick >= limit) return std::nullopt;
      if (needs(entry)) return std::make_pair(static_cast<size_t>(entry), tick);
      ++scan_;
    }
    return std::nullopt;
  }
  void consume() { ++scan_; }
  bool exhausted() const { return scan_ >= events_.size(); }

  void set_resident(size_t entry, bool resident);

  // A resident entry whose next use is after `candidate_tick` and not before `protect_until`,
  // the farthest first; nullopt when none qualifies.
  std::optional<size_t> pick_victim(uint32_t cursor, uint32_t candidate_tick,
                                    uint32_t protect_until);

 private:
  const Plan& plan_;
  std::vector<std::pair<uint32_t, uint32_t>> events_;  // (step, entry), ascending
  size_t scan_ = 0;
  std::vector<uint8_t> resident_;
  std::vector<std::pair<uint32_t, uint32_t>> victims_;  // (next use, entry), ascending
  bool victims_valid_ = false;
  uint32_t victims_cursor_ = 0;
};

}  // namespace hpcdl
