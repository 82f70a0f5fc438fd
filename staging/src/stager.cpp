#include "stager.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>
#include <optional>
#include <unordered_map>
#include <vector>

#include "copy_engine.h"
#include "copy_threads.h"
#include "eviction.h"
#include "manifest.h"
#include "peer.h"
#include "peer_deferrals.h"
#include "plan.h"
#include "residency.h"
#include "status_map.h"

namespace hpcdl {
namespace {

namespace so = status_offset;
using Clock = std::chrono::steady_clock;

using Job = CopyThreads::Job;
using Done = CopyThreads::Done;

// Every line names the node: a multi-node job log holds one start and one stop line per node.
const std::string& log_prefix() {
  static const std::string prefix = [] {
    char host[256] = {};
    if (::gethostname(host, sizeof host - 1) != 0) host[0] = '\0';
    return "hpcdl-stage on " + std::string(host[0] ? host : "?") + ": ";
  }();
  return prefix;
}

void log_line(const std::string& msg) { std::cerr << log_prefix() << msg << std::endl; }

struct PlanFileId {
  ino_t ino = 0;
  struct timespec mtime {};
  bool operator!=(const PlanFileId& o) const {
    return ino != o.ino || mtime.tv_sec != o.mtime.tv_sec || mtime.tv_nsec != o.mtime.tv_nsec;
  }
};

PlanFileId plan_file_id(const std::string& path) {
  struct stat st {};
  PlanFileId id;
  if (::stat(path.c_str(), &st) == 0) {
    id.ino = st.st_ino;
    id.mtime = st.st_mtim;
  }
  return id;
}

// NOTE [threads]
// A stager runs three kinds of threads; what each may touch, and under which lock:
// - The coordinator (the thread that calls run(): coordinate(), dispatch(), drain_done(),
//   evict(), adopt_plan(), reload_plan()) owns the plan, the schedule, the residency (space_),
//   the peer deferrals, every "Coordinator-only state" member below and the status map: it is
//   the status map's only writer (states, counters, heartbeat), so none of that needs a lock.
//   It takes the signals (sigtimedwait; every thread has them blocked) and sets cancel_.
// - The copy threads (copiers_, opt_.threads of them; copy_threads.h) take a Job from their
//   queue and hand back a Done, both under the CopyThreads' mu_; the coordinator reaches them
//   only through CopyThreads' calls (start, queue, take_done, wait_done, peer_down, stop). A
//   Job carries copies of what its thread needs (source, dest, size, peer), so a copy thread
//   never reads the plan, the status map or copies_. Between the two they use engine_
//   (CopyEngine: thread-safe, see copy_engine.h; the coordinator's evict() removes files while
//   copies run), client_ (PeerClient: thread-safe, its own lock), the down peers and each
//   peer's failed reply checks under the CopyThreads' peer_mu_ (written by copy threads; the
//   down set read by the coordinator's dispatch), and
//   the atomics cancel_ and the CopyThreads' counters.
// - The server threads (kPeerServeThreads, owned by server_) serve peers. The coordinator
//   reaches them only through PeerServer::offer/withdraw (under the server's own lock) and its
//   atomic counters (publish_served); they read the stage tree through tree_ (its own lock)
//   and never touch the status map or the plan.
// Shutdown order (run()): the coordinator stops dispatching, stops and joins the copy threads
// (copiers_.stop()), then resets server_ (joining its threads) before the tree it serves from
// goes. tests/test_staging_sanitizers.py runs all three kinds under TSan (-DHPCDL_TSAN=ON).
class Stager {
 public:
  explicit Stager(const StagerOptions& opt)
      : opt_(opt),
        meta_(opt.stage_dir + "/.hpcdl/sessions/" + opt.session),
        plan_(read_plan(meta_ + "/plan")),
        status_(StatusMap::open(meta_ + "/status", plan_.dataset_files,
                                fingerprint_number(plan_.fingerprint))),
        progress_(ProgressFile::open(meta_ + "/progress")),
        manifest_(opt.stage_dir + "/.hpcdl/manifest"),
        tree_(opt.stage_dir, manifest_),
        pfs_(PfsEmulation::from_env()),
        engine_(tree_, manifest_, meta_, pfs_, opt.verify, cancel_),
        space_(opt.capacity ? *opt.capacity : default_capacity(opt.stage_dir)) {
    plan_id_ = plan_file_id(meta_ + "/plan");
    first_epoch_ = plan_.epoch_begin;
    if (opt.peer) {
      secret_ = read_peer_secret(STDIN_FILENO);
      client_ = std::make_unique<PeerClient>(secret_);
    }
    copiers_ = std::make_unique<CopyThreads>(engine_, client_.get(), opt.verify, opt.stage_dir,
                                             cancel_, log_line);
    if (opt.peer && opt.peer_listen_fd >= 0) {
      server_ = std::make_unique<PeerServer>(opt.peer_listen_fd, secret_, tree_, kPeerServeThreads,
                                             log_line);
    }
  }

  int run() {
    status_.store(so::kPid, static_cast<uint64_t>(::getpid()));
    status_.store32(so::kRunState, static_cast<uint32_t>(RunState::Starting));
    for (size_t off : {so::kFilesStaged, so::kBytesStaged, so::kFailures, so::kEvictions,
                       so::kFilesReused, so::kBytesReused, so::kBytesResident, so::kPeerFiles,
                       so::kPeerBytes, so::kPeerFallbacks, so::kFilesServed, so::kBytesServed,
                       so::kPfsOpens}) {
      status_.store(off, 0);
    }
    status_.store32(so::kFlags, 0);
    status_.store(so::kCapacity, space_.capacity());
    status_.heartbeat();
    if (!opt_.quiet) {
      log_line("staging " + std::to_string(plan_.entries.size()) + " files into " +
               opt_.stage_dir + " with " + std::to_string(opt_.threads) + " threads, capacity " +
               human_bytes(space_.capacity()) +
               (pfs_.active() ? " (emulated PFS: latency_ms=" + std::to_string(pfs_.latency_ms()) +
                                    ", mbps=" + std::to_string(pfs_.mbps()) + ")"
                              : "") +
               (opt_.nice ? ", at nice +" + std::to_string(opt_.nice) : std::string()) +
               (opt_.nice_later && !opt_.once
                    ? ", nice +" + std::to_string(opt_.nice_later) + " after epoch " +
                          std::to_string(first_epoch_ + 1)
                    : std::string()) +
               (opt_.peer ? std::string(", peers: ") + (server_ ? "serving, " : "not serving, ") +
                                std::to_string(plan_.peers.size()) + " to fetch from"
                          : ""));
    }
    adopt_plan();
    status_.store32(so::kRunState, static_cast<uint32_t>(RunState::Running));

    copiers_->start(opt_.threads);
    const int code = coordinate();
    copiers_->stop();
    publish_served();
    server_.reset();  // no peer is served once the stager stops
    // Whatever was queued or cancelled is not on disk: back to PENDING.
    for (size_t i = 0; i < inflight_.size(); ++i) {
      if (inflight_[i]) status_.set_state(plan_.entries[i].file_id, FileState::Pending);
    }
    drain_done();
    status_.heartbeat();
    status_.store32(so::kRunState, static_cast<uint32_t>(RunState::Stopped));
    if (!opt_.quiet) log_last_line();
    return code;
  }

  // The one last line: why it ended and what it did.
  void log_last_line() {
    const auto count = [this](size_t offset) { return std::to_string(status_.load(offset)); };
    std::string peers;
    if (opt_.peer) {
      peers = ", " + count(so::kPeerFiles) + " from peers (" + count(so::kPeerFallbacks) +
              " fell back to the PFS), " + count(so::kFilesServed) + " served";
    }
    log_line(ending_ + ": " + count(so::kFilesStaged) + " files (" + count(so::kBytesStaged) +
             " bytes) copied, " + count(so::kFilesReused) + " reused, " + count(so::kFailures) +
             " failed, " + count(so::kEvictions) + " evicted" + peers);
  }


 private:
  // Validates staged files for the (new) plan: copies that may be reused (see
  // CopyEngine::reusable) are READY and count against the capacity, anything else is PENDING.
  void adopt_plan() {
    inflight_.assign(plan_.entries.size(), 0);
    too_big_.assign(plan_.entries.size(), 0);
    deferrals_.reset(plan_.entries.size());
    schedule_ = std::make_unique<NextUseSchedule>(plan_);
    uint64_t resident = 0, ready = 0;
    std::vector<char> buffer(kCopyBuffer);
    for (size_t i = 0; i < plan_.entries.size(); ++i) {
      const auto& e = plan_.entries[i];
      const FileState s = status_.state(e.file_id);
      const bool known_ready = s == FileState::Ready && copies_.count(e.file_id);
      if (known_ready || reuse(i, buffer)) {
        status_.set_state(e.file_id, FileState::Ready);
        schedule_->set_resident(i, true);
        resident += e.size;
        ++ready;
      } else if (s == FileState::Ready || s == FileState::Copying || s == FileState::Failed) {
        status_.set_state(e.file_id, FileState::Pending);  // stale, partial or worth a retry
      }
    }
    space_.adopt(resident);
    plan_ready_ = ready;
    mark_too_big();
    status_.store(so::kBytesResident, space_.resident());
    status_.store(so::kPlanHash, plan_.hash);
    status_.store(so::kPlanEntries, plan_.entries.size());
    status_.store(so::kPlanReady, plan_ready_);
    schedule_->seek(cursor(), true);
  }

  // Whether entry i's copy on disk, left by an earlier job, may be reused (CopyEngine::reusable):
  // then it is this stager's, counted and offered to peers. A piece never is (its size is not
  // its source's): one a job left is deleted here, and copied again.
  bool reuse(size_t i, std::vector<char>& buffer) {
    const auto& e = plan_.entries[i];
    if (plan_.is_piece(i)) {
      engine_.discard(plan_.dest(e));
      return false;
    }
    const auto reused = engine_.reusable(plan_.source(e), plan_.dest(e), e.size, buffer);
    if (!reused) return false;
    status_.add(so::kFilesReused, 1);
    status_.add(so::kBytesReused, e.size);
    copies_[e.file_id] = *reused;
    const auto record = manifest_.find(plan_.dest(e), reused->ino, reused->dev);
    if (server_ && record) {
      server_->offer(e.file_id,
                     ServedCopy{plan_.dest(e), e.size, record->source_id, *reused, false, 0});
    }
    return true;
  }

  // Files that can never fit (larger than the capacity; every file when it is 0) are read from
  // the PFS. One line per stager says how many and what to set, not one line per file.
  void mark_too_big() {
    uint64_t count = 0, bytes = 0, largest = 0;
    for (size_t i = 0; i < plan_.entries.size(); ++i) {
      const auto& e = plan_.entries[i];
      if (space_.capacity() != 0 && e.size <= space_.capacity()) continue;
      if (status_.state(e.file_id) == FileState::Ready) continue;  // reused or kept resident
      too_big_[i] = 1;
      ++count;
      bytes += e.size;
      largest = std::max(largest, e.size);
    }
    if (count == 0 || reported_too_big_ || opt_.quiet) return;
    reported_too_big_ = true;
    log_line(std::to_string(count) + " of " + std::to_string(plan_.entries.size()) +
             " planned files (" + human_bytes(bytes) + ") do not fit the stage capacity of " +
             human_bytes(space_.capacity()) + " and are read from the PFS; set --stage-capacity "
             "to at least " + std::to_string(std::max<uint64_t>(largest, 1)) +
             " bytes (the largest of them) to stage them");
  }

  // The slowest local rank's position (epoch * steps_per_epoch + steps done); -1: no rank yet.
  int64_t slowest_position() const {
    int64_t slowest = -1;
    bool any = false;
    for (const auto& c : progress_.read()) {
      const int64_t pos = c.position < 0 ? 0 : c.position;
      slowest = any ? std::min(slowest, pos) : pos;
      any = true;
    }
    return slowest;
  }

  uint32_t cursor() const {
    const int64_t slowest = slowest_position();
    const int64_t base = plan_.epoch_begin * static_cast<int64_t>(plan_.steps_per_epoch);
    const int64_t rel = slowest >= 0 ? slowest - base : 0;
    return rel <= 0 ? 0 : static_cast<uint32_t>(std::min<int64_t>(rel, UINT32_MAX - 1));
  }

  // --nice-later: once the slowest rank has passed the first epoch of the first plan, every
  // thread goes below the ranks. Epoch 1 copies from the PFS what the ranks are about to read
  // (they wait for it); later the stager works an epoch ahead (docs/staging.md, "Below the
  // ranks"). Niceness is per thread on Linux, so each one of /proc/self/task is set.
  void nice_when_ahead() {
    if (!opt_.nice_later || niced_later_ || opt_.once || !plan_.steps_per_epoch) return;
    const int64_t end = (first_epoch_ + 1) * static_cast<int64_t>(plan_.steps_per_epoch);
    if (slowest_position() < end) return;
    niced_later_ = true;
    std::string failed;
    std::error_code ec;
    for (const auto& task : std::filesystem::directory_iterator("/proc/self/task", ec)) {
      const auto tid = static_cast<id_t>(std::stoul(task.path().filename().string()));
      errno = 0;
      const int now = ::getpriority(PRIO_PROCESS, tid);
      if (errno != 0) continue;  // a thread that has ended since (ESRCH)
      const int want = std::min(19, now + static_cast<int>(opt_.nice_later));
      if (::setpriority(PRIO_PROCESS, tid, want) != 0 && errno != ESRCH) failed = errno_text(errno);
    }
    if (ec) failed = ec.message();
    // Done quietly: the start line announced it, and a stager says one start and one stop line.
    if (!failed.empty()) {
      log_line("cannot lower its priority after epoch " + std::to_string(first_epoch_ + 1) +
               " (setpriority): " + failed + "; it goes on at the priority it had");
    }
  }

  bool pending_signal() {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGHUP);
    sigaddset(&set, SIGUSR1);
    const struct timespec zero {};
    const int sig = ::sigtimedwait(&set, nullptr, &zero);
    if (sig > 0) {
      ending_ = sig == SIGUSR1   ? "finished (the job ended)"
                : sig == SIGTERM ? "stopped on SIGTERM"
                : sig == SIGINT  ? "stopped on SIGINT"
                                 : "stopped on SIGHUP";
    }
    return sig > 0;
  }

  bool parent_gone() const {
    return opt_.parent_pid > 0 && (::getppid() != opt_.parent_pid);
  }

  int coordinate() {
    auto last_plan_check = Clock::now();
    for (;;) {
      if (pending_signal()) {
        cancel_.store(true);
        return 0;
      }
      if (parent_gone()) {
        ending_ = "stopped (its parent process exited)";
        cancel_.store(true);
        return 0;
      }
      status_.heartbeat();
      publish_served();
      drain_done();
      const auto now = Clock::now();
      if (!opt_.once && now - last_plan_check > std::chrono::milliseconds(200)) {
        last_plan_check = now;
        if (plan_file_id(meta_ + "/plan") != plan_id_) reload_requested_ = true;
        nice_when_ahead();
      }
      if (reload_requested_ && inflight_count_ == 0) reload_plan();
      const bool blocked = reload_requested_ ? true : dispatch();
      if (opt_.once && inflight_count_ == 0 && (blocked || schedule_->exhausted())) {
        ending_ = "finished";
        status_.store32(so::kRunState, static_cast<uint32_t>(RunState::Done));
        return 0;
      }
      copiers_->wait_done(std::chrono::milliseconds(20));
    }
  }

  void reload_plan() {
    reload_requested_ = false;
    plan_id_ = plan_file_id(meta_ + "/plan");
    Plan next;
    try {
      next = read_plan(meta_ + "/plan");
    } catch (const StageError& e) {
      log_line(std::string(e.what()) + " (keeping the previous plan)");
      return;
    }
    if (next.dataset_files != plan_.dataset_files) {
      log_line("new plan " + meta_ + "/plan is for a different data set; keeping the previous "
               "plan");
      return;
    }
    // Files still resident from the old plan stay, with no planned use (first to be evicted).
    std::vector<uint8_t> in_next(plan_.dataset_files);
    for (const auto& e : next.entries) in_next[e.file_id] = 1;
    for (size_t i = 0; i < plan_.entries.size(); ++i) {
      const auto& e = plan_.entries[i];
      if (!in_next[e.file_id] && status_.state(e.file_id) == FileState::Ready) {
        next.add(e.file_id, e.size, plan_.dest(e), plan_.source(e), {});
        if (plan_.is_piece(i)) next.set_piece(next.entries.size() - 1, plan_.piece(i));
      }
    }
    schedule_.reset();
    plan_ = std::move(next);
    adopt_plan();  // the disk may have room again
  }

  // Queues copies in next-use order within the window and the capacity. Returns true when
  // blocked (capacity full, nothing evictable) so a stage-only run can finish.
  bool dispatch() {
    if (space_.out_of_space()) return true;
    const uint32_t cur = cursor();
    schedule_->seek(cur);
    const uint32_t limit = opt_.window_steps ? cur + opt_.window_steps : NextUseSchedule::kNever;
    const size_t max_inflight = static_cast<size_t>(opt_.threads) * 4;
    auto needs = [this](size_t i) {
      if (inflight_[i] || too_big_[i]) return false;
      const FileState s = status_.state(plan_.entries[i].file_id);
      return s == FileState::Pending || s == FileState::Evicted;
    };
    auto next_use = [&](size_t i) { return schedule_->next_use(i, cur); };
    release_deferred(cur);
    std::vector<Job> batch;
    bool blocked = false;
    while (inflight_count_ + batch.size() < max_inflight) {
      // The earlier use of two: the next one in the scan, and the first deferred peer fetch
      // whose home holds the file by now.
      const auto ready = deferrals_.front(next_use, needs, cur);
      const auto scanned = schedule_->peek(limit, needs);
      const bool from_ready = ready && ready->tick < limit && (!scanned || ready->tick <= scanned->second);
      if (!from_ready && !scanned) break;
      const auto [i, tick] = from_ready ? std::make_pair(ready->entry, ready->tick) : *scanned;
      const auto& e = plan_.entries[i];
      const PeerSource from = peer_source(i);
      // The home reads it at ready_tick: set it aside until the ranks have passed that step
      // (the home's stager has had it READY by then, unless the home's loader missed it), and
      // go on with the copies behind it (one late home must not hold back the rest). A --once
      // run has no cursor that moves, so it never waits.
      if (!from_ready && from.peer >= 0 && !opt_.once && from.ready_tick >= cur &&
          !copiers_->peer_down(plan_.peers[from.peer].node)) {
        schedule_->consume();
        deferrals_.defer(i, tick, from.ready_tick);
        continue;
      }
      if (e.size > space_.capacity()) {  // it shrank on ENOSPC: that message said it
        too_big_[i] = 1;
        continue;
      }
      if (!make_room(e.size, cur, tick)) {
        status_.set_flag(kFlagCapacityFull);
        blocked = true;
        break;
      }
      if (from_ready) {
        deferrals_.pop();
      } else {
        schedule_->consume();
      }
      batch.push_back(start_job(i, tick, cur, from));
    }
    queue(std::move(batch));
    return blocked;
  }

  // Evicts (farthest next use first, never what the ranks need within --protect-steps) until
  // `size` bytes fit beside what is resident and in flight; false when they cannot.
  bool make_room(uint64_t size, uint32_t cur, uint32_t tick) {
    while (!space_.fits(size)) {
      const auto victim = schedule_->pick_victim(cur, tick, cur + opt_.protect_steps);
      if (!victim) break;
      evict(*victim);
    }
    return space_.fits(size);
  }

  // Where entry i comes from: its peer, or the PFS (PeerSource{}). Without --peer (no secret) a
  // plan's peer section is not used; with --stage-verify a piece comes from the PFS, whose
  // range the stager checksums as it copies (a home holds the checksum of a whole file only).
  PeerSource peer_source(size_t i) const {
    if (!opt_.peer || (opt_.verify && plan_.is_piece(i))) return PeerSource{};
    return plan_.peer_source(i);
  }

  // Entry i's copy, in flight from now: COPYING, its bytes counted, from its peer if planned.
  // A piece asks its home for its shard's range (the file id its home knows).
  Job start_job(size_t i, uint32_t tick, uint32_t cur, const PeerSource& from) {
    const auto& e = plan_.entries[i];
    inflight_[i] = 1;
    space_.started(e.size);
    status_.set_state(e.file_id, FileState::Copying);
    Job job{i, plan_.source(e), plan_.dest(e), e.file_id, e.size, std::nullopt};
    if (const PieceSource piece = plan_.piece(i); piece.piece) {
      job.file_id = piece.shard_id;
      job.piece = SourceRange{piece.offset, e.size, piece.shard_size, false};
    }
    if (from.peer >= 0) {
      job.peer = plan_.peers[from.peer];
      job.may_wait = !opt_.once && tick > cur + opt_.protect_steps;
    }
    return job;
  }

  // Hands `batch` to the copy threads.
  void queue(std::vector<Job> batch) {
    inflight_count_ += batch.size();
    copiers_->queue(std::move(batch));
  }

  // Deferred peer fetches whose home has read the file before step `cur` (or whose peer is
  // down: then the PFS) become ready (PeerDeferrals::release).
  void release_deferred(uint32_t cur) {
    deferrals_.release([&](size_t i) { return schedule_->next_use(i, cur); },
                       [&](const PeerDeferrals::Deferred& d) {
                         const PeerSource from = plan_.peer_source(d.entry);
                         return d.ready_tick < cur || copiers_->peer_down(plan_.peers[from.peer].node);
                       },
                       cur);
  }

  void evict(size_t i) {
    const auto& e = plan_.entries[i];
    // State first: a reader that saw READY and then finds no file falls back to the PFS.
    status_.set_state(e.file_id, FileState::Evicted);
    const auto copy = copies_.find(e.file_id);
    if (server_) server_->withdraw(e.file_id);
    const int err = copy == copies_.end() ? ENOENT : engine_.remove(plan_.dest(e), copy->second);
    if (err != 0 && err != ENOENT) {
      log_line("cannot evict " + opt_.stage_dir + "/" + plan_.dest(e) + ": " + errno_text(err) +
               "; its space stays counted as used");
      return;
    }
    schedule_->set_resident(i, false);
    space_.evicted(e.size);
    --plan_ready_;
    copies_.erase(e.file_id);
    status_.add(so::kEvictions, 1);
    status_.store(so::kBytesResident, space_.resident());
    status_.store(so::kPlanReady, plan_ready_);
  }

  // A copy published: READY, resident, served to peers, counted.
  void landed(const Done& d) {
    const auto& e = plan_.entries[d.entry];
    status_.set_state(e.file_id, FileState::Ready);
    copies_[e.file_id] = d.result.id;
    if (server_ && !plan_.is_piece(d.entry)) {  // a piece is no file of the data set
      server_->offer(e.file_id, ServedCopy{plan_.dest(e), e.size, d.result.source_id,
                                           d.result.id, d.result.has_checksum, d.result.checksum});
    }
    if (d.from_peer) {
      status_.add(so::kPeerFiles, 1);
      status_.add(so::kPeerBytes, d.result.bytes);
    }
    schedule_->set_resident(d.entry, true);
    if (space_.landed(e.size)) status_.store(so::kCapacity, space_.capacity());
    ++plan_ready_;
    status_.add(so::kBytesStaged, d.result.bytes);
    status_.add(so::kFilesStaged, 1);
    status_.store(so::kBytesResident, space_.resident());
    status_.store(so::kPlanReady, plan_ready_);
  }

  void drain_done() {
    for (auto& d : copiers_->take_done()) {
      const auto& e = plan_.entries[d.entry];
      inflight_[d.entry] = 0;
      space_.finished(e.size);
      --inflight_count_;
      if (d.peer_fallback) status_.add(so::kPeerFallbacks, 1);
      switch (d.result.outcome) {
        case CopyOutcome::Ok:
          landed(d);
          break;
        case CopyOutcome::NoSpace:
          status_.set_state(e.file_id, FileState::Pending);
          status_.set_flag(kFlagNoSpace);
          // Stop growing: what is resident now is the most this node can hold.
          if (space_.ran_out_of_space()) log_line(d.result.message);
          status_.store(so::kCapacity, space_.capacity());
          break;
        case CopyOutcome::Cancelled:
          status_.set_state(e.file_id, FileState::Pending);
          if (d.ask_again) {  // once the ranks pass this step
            const uint32_t cur = cursor();
            deferrals_.defer(d.entry, schedule_->next_use(d.entry, cur), cur);
          }
          break;
        case CopyOutcome::Transient:
        case CopyOutcome::Failed:
          status_.set_state(e.file_id, FileState::Failed);
          if (status_.load(so::kFailures) < kMaxLoggedFailures) log_line(d.result.message);
          status_.add(so::kFailures, 1);
          break;
      }
    }
  }

  // Counters the copy threads and the peer server keep, into the status map.
  void publish_served() {
    status_.store(so::kPfsOpens, copiers_->pfs_opens());
    if (client_) status_.store(so::kPeerConnections, client_->connections_opened());
    if (!server_) return;
    status_.store(so::kFilesServed, server_->files_served());
    status_.store(so::kBytesServed, server_->bytes_served());
  }

  StagerOptions opt_;
  std::string meta_;
  Plan plan_;
  StatusMap status_;
  ProgressFile progress_;
  Manifest manifest_;
  StageTree tree_;
  PfsEmulation pfs_;
  std::atomic<bool> cancel_{false};
  CopyEngine engine_;
  Residency space_;  // the capacity and what counts against it (coordinator-only)
  PlanFileId plan_id_;
  std::string secret_;                  // the job's secret (peer tier), never written anywhere
  std::unique_ptr<PeerClient> client_;  // with --peer: connections to peers, kept between fetches
  std::unique_ptr<PeerServer> server_;  // after tree_: stops before the tree closes
  // After engine_ and client_: its threads stop before what they use goes.
  std::unique_ptr<CopyThreads> copiers_;

  // Coordinator-only state.
  std::unique_ptr<NextUseSchedule> schedule_;
  std::vector<uint8_t> inflight_, too_big_;
  PeerDeferrals deferrals_;  // peer fetches set aside until their home has read the file
  std::unordered_map<uint64_t, CopyId> copies_;  // file id -> the copy this stager may evict
  size_t inflight_count_ = 0;
  uint64_t plan_ready_ = 0;
  bool reload_requested_ = false, reported_too_big_ = false;
  bool niced_later_ = false;
  int64_t first_epoch_ = 0;  // the first plan's epoch_begin (--nice-later)
  // The one last line's first words: why the stager ends. SIGUSR1 is the trainer's "the job
  // ended" (StagingSession.close); SIGTERM/SIGINT/SIGHUP come from someone else.
  std::string ending_ = "stopped";
};

}  // namespace

uint64_t default_capacity(const std::string& dir) {
  struct statvfs vfs {};
  if (::statvfs(dir.c_str(), &vfs) != 0) return 0;
  const uint64_t free_bytes = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
  const uint64_t total = static_cast<uint64_t>(vfs.f_blocks) * vfs.f_frsize;
  const uint64_t margin = std::max<uint64_t>(total / 20, 1ull << 30);
  return free_bytes > margin ? free_bytes - margin : 0;
}

int run_stager(const StagerOptions& options) {
  // Signals are taken synchronously by the coordinator (sigtimedwait); the copy threads inherit
  // the mask, so no handler and no global flag are needed.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGHUP);
  sigaddset(&set, SIGUSR1);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  // Below the ranks: the stager works ahead of need, so a copy that waits a few ms for a core
  // costs nothing, while a rank that waits for one holds back every rank at the next
  // allreduce. Threads inherit their creator's niceness (Linux), so it is set before any starts.
  if (options.nice > 0) {
    errno = 0;
    if (::nice(static_cast<int>(options.nice)) == -1 && errno != 0) {
      log_line("cannot lower its priority (nice): " + errno_text(errno) +
               "; it runs at the priority it was started with");
    }
  }
  try {
    Stager stager(options);
    return stager.run();
  } catch (const StageError& e) {
    log_line(std::string("error: ") + e.what());
    return 1;
  }
}

}  // namespace hpcdl
