// Peer fetches set aside until their home has read the file (docs/staging.md, "Peer tier"): a
// fetch planned from a peer waits until the ranks pass the home's first read (its ready tick),
// and the copies behind it go on meanwhile. The coordinator's alone, no lock (stager.cpp,
// NOTE [threads]).
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <vector>

namespace hpcdl {

class PeerDeferrals {
 public:
  struct Deferred {
    size_t entry;         // the plan entry
    uint32_t tick;        // the use it is copied for
    uint32_t ready_tick;  // the home's first read
  };
  using NextUse = std::function<uint32_t(size_t entry)>;  // kNever: no use ahead

  // A new plan of `entries` entries: nothing set aside.
  void reset(size_t entries);

  // Sets `entry` aside (for its use at `tick`) until the ranks pass `ready_tick`; nothing when
  // it is set aside already.
  void defer(size_t entry, uint32_t tick, uint32_t ready_tick);

  // Those that `released` says may go now (the home has read the file, or it is down: then the
  // PFS) join the ready queue, in next-use order. One whose use the ranks have passed waits for
  // its next use, or is dropped when it has none.
  void release(const NextUse& next_use, const std::function<bool(const Deferred&)>& released,
               uint32_t cur);

  // The first ready fetch whose file is still `needed`, its use brought up to `cur`; those
  // needed no more are dropped. It stays queued until pop().
  std::optional<Deferred> front(const NextUse& next_use,
                                const std::function<bool(size_t)>& needed, uint32_t cur);
  void pop();  // the front, dispatched

 private:
  std::vector<Deferred> waiting_;  // in scan order
  std::deque<Deferred> ready_;     // in next-use order
  std::vector<uint8_t> held_;      // per entry: in waiting_ or ready_
};

}  // namespace hpcdl
