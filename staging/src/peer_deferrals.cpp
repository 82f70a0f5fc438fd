#include "peer_deferrals.h"

#include <algorithm>

#include "eviction.h"

namespace hpcdl {

void PeerDeferrals::reset(size_t entries) {
  waiting_.clear();
  ready_.clear();
  held_.assign(entries, 0);
}

void PeerDeferrals::defer(size_t entry, uint32_t tick, uint32_t ready_tick) {
  if (held_[entry]) return;
  held_[entry] = 1;
  waiting_.push_back(Deferred{entry, tick, ready_tick});
}

void PeerDeferrals::release(const NextUse& next_use,
                            const std::function<bool(const Deferred&)>& released, uint32_t cur) {
  size_t kept = 0;
  bool moved = false;
  for (Deferred d : waiting_) {
    if (d.tick < cur) d.tick = next_use(d.entry);
    if (d.tick == NextUseSchedule::kNever) {
      held_[d.entry] = 0;
      continue;
    }
    if (released(d)) {
      ready_.push_back(d);
      moved = true;
    } else {
      waiting_[kept++] = d;
    }
  }
  waiting_.resize(kept);
  if (moved) {
    std::stable_sort(ready_.begin(), ready_.end(),
                     [](const Deferred& a, const Deferred& b) { return a.tick < b.tick; });
  }
}

std::optional<PeerDeferrals::Deferred> PeerDeferrals::front(
    const NextUse& next_use, const std::function<bool(size_t)>& needed, uint32_t cur) {
  while (!ready_.empty()) {
    Deferred& d = ready_.front();
    if (d.tick < cur) d.tick = next_use(d.entry);
    if (needed(d.entry) && d.tick != NextUseSchedule::kNever) return d;
    held_[d.entry] = 0;
    ready_.pop_front();
  }
  return std::nullopt;
}

void PeerDeferrals::pop() {
  held_[ready_.front().entry] = 0;
  ready_.pop_front();
}

}  // namespace hpcdl
