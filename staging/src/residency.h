// What the stage dir holds against the stager's capacity (docs/staging.md, "Capacity and
// eviction"): the bytes of resident copies, the bytes of copies in flight, and the capacity
// itself, which shrinks to what is resident on ENOSPC/EDQUOT (staging stops growing) and grows
// back to cover a copy that was in flight then and still landed (admitted under the capacity it
// had, so never past it). The coordinator's alone, no lock (stager.cpp, NOTE [threads]).
#pragma once

#include <algorithm>
#include <cstdint>

namespace hpcdl {

class Residency {
 public:
  explicit Residency(uint64_t capacity) : capacity_(capacity) {}

  uint64_t capacity() const { return capacity_; }
  uint64_t resident() const { return resident_; }
  bool out_of_space() const { return no_space_; }

  // A new plan: `resident` bytes of it are on disk, nothing in flight that counts; the disk
  // may have room again.
  void adopt(uint64_t resident) {
    resident_ = resident;
    no_space_ = false;
  }
  // Whether `size` more bytes fit beside what is resident and in flight.
  bool fits(uint64_t size) const { return resident_ + inflight_ + size <= capacity_; }
  void started(uint64_t size) { inflight_ += size; }   // a copy in flight
  void finished(uint64_t size) { inflight_ -= std::min(inflight_, size); }  // whatever came of it
  // A copy landed; true when the capacity grew back to cover it.
  bool landed(uint64_t size) {
    resident_ += size;
    if (!no_space_ || resident_ <= capacity_) return false;
    capacity_ = resident_;
    return true;
  }
  void evicted(uint64_t size) { resident_ -= std::min(resident_, size); }
  // ENOSPC/EDQUOT: true the first time (say it once); the capacity becomes what is resident.
  bool ran_out_of_space() {
    const bool first = !no_space_;
    no_space_ = true;
    capacity_ = std::min(capacity_, resident_);
    return first;
  }

 private:
  uint64_t capacity_;
  uint64_t resident_ = 0, inflight_ = 0;
  bool no_space_ = false;
};

}  // namespace hpcdl
