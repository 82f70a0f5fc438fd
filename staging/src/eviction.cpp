#include "eviction.h"

#include <algorithm>

namespace hpcdl {

NextUseSchedule::NextUseSchedule(const Plan& plan) : plan_(plan), resident_(plan.entries.size()) {
  size_t total = 0;
  for (const auto& e : plan.entries) total += e.tick_count;
  events_.reserve(total);
  for (size_t i = 0; i < plan.entries.size(); ++i) {
    for (uint32_t t : plan.ticks(plan.entries[i])) {
      events_.emplace_back(t, static_cast<uint32_t>(i));
    }
  }
  // Ties keep plan order (first use, interleaved across local ranks).
  std::sort(events_.begin(), events_.end());
}

uint32_t NextUseSchedule::next_use(size_t entry, uint32_t cursor) const {
  const TickSpan ticks = plan_.ticks(plan_.entries[entry]);
  auto it = std::lower_bound(ticks.begin(), ticks.end(), cursor);
  return it == ticks.end() ? kNever : *it;
}

void NextUseSchedule::seek(uint32_t cursor, bool rewind) {
  auto it = std::lower_bound(events_.begin(), events_.end(), std::make_pair(cursor, 0u));
  const auto pos = static_cast<size_t>(it - events_.begin());
  if (rewind || pos > scan_) scan_ = pos;
}

void NextUseSchedule::set_resident(size_t entry, bool resident) {
  resident_[entry] = resident ? 1 : 0;
}

std::optional<size_t> NextUseSchedule::pick_victim(uint32_t cursor, uint32_t candidate_tick,
                                                   uint32_t protect_until) {
  if (!victims_valid_ || victims_cursor_ != cursor) {
    victims_.clear();
    for (size_t i = 0; i < resident_.size(); ++i) {
      if (resident_[i]) victims_.emplace_back(next_use(i, cursor), static_cast<uint32_t>(i));
    }
    std::sort(victims_.begin(), victims_.end());
    victims_valid_ = true;
    victims_cursor_ = cursor;
  }
  while (!victims_.empty()) {
    const auto [use, entry] = victims_.back();
    if (!resident_[entry]) {
      victims_.pop_back();
      continue;
    }
    if (use <= candidate_tick || use < protect_until) return std::nullopt;
    victims_.pop_back();
    return entry;
  }
  victims_valid_ = false;  // files made resident since the last build are looked at next time
  return std::nullopt;
}

}  // namespace hpcdl
