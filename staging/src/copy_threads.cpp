#include "copy_threads.h"

#include <utility>

namespace hpcdl {
namespace {

constexpr int kMaxAttempts = 4;

}  // namespace

CopyThreads::CopyThreads(CopyEngine& engine, PeerClient* client, bool verify,
                         std::string stage_dir, const std::atomic<bool>& cancel,
                         std::function<void(const std::string&)> log)
    : engine_(engine),
      client_(client),
      verify_(verify),
      stage_dir_(std::move(stage_dir)),
      cancel_(cancel),
      log_(std::move(log)) {}

CopyThreads::~CopyThreads() { stop(); }

void CopyThreads::start(unsigned threads) {
  threads_ = threads;
  for (unsigned t = 0; t < threads; ++t) workers_.emplace_back([this, t] { work(t); });
}

void CopyThreads::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    jobs_.clear();
  }
  cv_work_.notify_all();
  for (auto& w : workers_) w.join();
  workers_.clear();
}

void CopyThreads::queue(std::vector<Job> batch) {
  if (batch.empty()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& job : batch) jobs_.push_back(std::move(job));
  }
  cv_work_.notify_all();
}

std::vector<CopyThreads::Done> CopyThreads::take_done() {
  std::vector<Done> done;
  std::lock_guard<std::mutex> lock(mu_);
  done.swap(done_);
  return done;
}

void CopyThreads::wait_done(std::chrono::milliseconds most) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_done_.wait_for(lock, most, [this] { return !done_.empty(); });
}

bool CopyThreads::peer_down(uint32_t node) {
  std::lock_guard<std::mutex> lock(peer_mu_);
  return down_.count(node) != 0;
}

void CopyThreads::work(unsigned tag) {
  std::vector<char> buffer(kCopyBuffer);
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_work_.wait(lock, [this] { return stopping_ || !jobs_.empty(); });
      if (jobs_.empty()) return;
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    Done done = run(job, buffer, tag);
    bool wake = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      // Wake the coordinator when the queue runs low, not once per file.
      wake = done_.empty() || jobs_.size() < threads_;
      done_.push_back(std::move(done));
    }
    if (wake) cv_done_.notify_one();
  }
}

CopyThreads::Done CopyThreads::run(const Job& job, std::vector<char>& buffer, unsigned tag) {
  Done done{job.entry, {}, false, false, false};
  CopyResult& result = done.result;
  if (job.peer && !peer_down(job.peer->node)) {
    PeerOutcome how = PeerOutcome::Ok;
    result = fetch_from(*job.peer, job, buffer, tag, &how);
    if (how == PeerOutcome::NotHere && job.may_wait) {
      // The home's stager is behind its ranks: not a fault, and no reason to read the PFS
      // while the use is still ahead.
      done.ask_again = true;
      result.outcome = CopyOutcome::Cancelled;
    }
    done.from_peer = result.outcome == CopyOutcome::Ok;
    done.peer_fallback = !done.from_peer && result.outcome != CopyOutcome::NoSpace &&
                         result.outcome != CopyOutcome::Cancelled;
  } else if (job.peer) {
    done.peer_fallback = true;
  }
  const bool pfs = !done.from_peer && result.outcome != CopyOutcome::NoSpace &&
                   result.outcome != CopyOutcome::Cancelled;
  for (int attempt = 0; pfs && attempt < kMaxAttempts; ++attempt) {
    pfs_opens_.fetch_add(1);
    result = engine_.copy(job.source, job.dest, buffer, tag, job.range());
    if (result.outcome != CopyOutcome::Transient || cancel_.load()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50 << (2 * attempt)));
  }
  if (result.outcome == CopyOutcome::Transient) {
    result.message += " (gave up after " + std::to_string(kMaxAttempts) +
                      " attempts; marked FAILED, readers use the PFS copy)";
  }
  return done;
}

// One peer fetch; a peer that cannot be reached or stays silent (after its handshake tries),
// or whose replies failed their check kPeerMaxBadReplies times, is down for the rest of the run
// (one line), so a lost node costs each copy thread one bounded wait and a forging one a few
// fetches, then the PFS.
CopyResult CopyThreads::fetch_from(const PeerAddress& peer, const Job& job,
                                   std::vector<char>& buffer, unsigned tag,
                                   PeerOutcome* outcome) {
  PeerOutcome& how = *outcome;  // the caller decides on "not here" too
  CopyResult r = copy_from_peer(engine_, *client_, peer, job.file_id, job.range(), job.source,
                                job.dest, verify_, buffer, tag, cancel_, &how);
  if (how == PeerOutcome::Cancelled) r.outcome = CopyOutcome::Cancelled;
  const bool lost = how == PeerOutcome::Unreachable || how == PeerOutcome::Refused;
  unsigned bad = 0;
  bool first = false;
  if (lost || how == PeerOutcome::Bad) {
    std::lock_guard<std::mutex> lock(peer_mu_);
    if (how == PeerOutcome::Bad) bad = ++bad_replies_[peer.node];
    if (lost || bad >= kPeerMaxBadReplies) first = down_.insert(peer.node).second;
  }
  const std::string gone = "node " + std::to_string(peer.node) +
                           " is not asked again, its files are read from the PFS";
  if (lost) {  // one line for the peer, none per file
    if (first) log_(r.message + "; " + gone);
    return r;
  }
  if (how != PeerOutcome::Ok && how != PeerOutcome::Cancelled &&
      !(how == PeerOutcome::NotHere && job.may_wait) &&
      logged_peer_failures_.fetch_add(1) < kMaxLoggedFailures) {
    log_(r.message + "; " + stage_dir_ + "/" + job.dest + " is read from the PFS instead");
  }
  if (first) {
    log_("peer " + peer.host + ":" + std::to_string(peer.port) + " sent " + std::to_string(bad) +
         " replies that failed their check (MAC or source checksum): damaged or forged; " + gone);
  }
  return r;
}

}  // namespace hpcdl
