// The stager's copy threads (stager.cpp, NOTE [threads]): each takes a Job from the queue,
// fetches it from its peer when the plan names one (PeerClient), else or then copies it from the
// PFS (CopyEngine, retrying transient faults), and hands back a Done. The coordinator queues
// jobs and takes what is done; a Job carries copies of all its thread needs, so a copy thread
// never reads the plan or the status map. Its calls are the coordinator's (one thread); what
// they share with the copy threads is under mu_ (queue, done, stopping) or peer_mu_ (the down
// peers and each peer's failed checks), or atomic.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "copy_engine.h"
#include "peer.h"
#include "plan.h"

namespace hpcdl {

constexpr size_t kCopyBuffer = 1u << 20;   // bytes of each copy thread's scratch buffer
constexpr size_t kMaxLoggedFailures = 20;  // failure lines per stager (copies, peer fetches)

class CopyThreads {
 public:
  struct Job {
    size_t entry;
    std::string source, dest;
    uint32_t file_id = 0;  // the file's id in its home's plan (a piece: its shard's)
    uint64_t size = 0;     // the copy's bytes (a piece: its length)
    std::optional<PeerAddress> peer;  // fetch from this peer first (the plan's peer section)
    bool may_wait = false;  // its use is far enough ahead to ask the peer again on "not here"
    std::optional<SourceRange> piece{};  // a piece of a shard: its range (else the whole file)

    SourceRange range() const { return piece ? *piece : SourceRange::file(size); }
  };

  struct Done {
    size_t entry;
    CopyResult result;
    bool from_peer = false;     // the copy came from a peer
    bool peer_fallback = false; // a peer was planned, the PFS gave the copy
    bool ask_again = false;     // the peer does not hold it yet: asked again a step later
  };

  // `client` is null without --peer. `stage_dir` names the copies in log lines; `log`
  // receives one line per event worth a line (from the copy threads).
  CopyThreads(CopyEngine& engine, PeerClient* client, bool verify, std::string stage_dir,
              const std::atomic<bool>& cancel, std::function<void(const std::string&)> log);
  ~CopyThreads();  // stop()
  CopyThreads(const CopyThreads&) = delete;
  CopyThreads& operator=(const CopyThreads&) = delete;

  void start(unsigned threads);           // threads get tags 0 .. threads - 1
  void stop();                            // drops the queued jobs, joins the threads
  void queue(std::vector<Job> batch);     // to the threads, in this order
  std::vector<Done> take_done();          // what they finished since the last call
  void wait_done(std::chrono::milliseconds most);  // until something is done, at most `most`

  // A peer that could not be reached or refused us (after its handshake tries), or whose
  // replies failed their check kPeerMaxBadReplies times: not asked again this run.
  bool peer_down(uint32_t node);
  uint64_t pfs_opens() const { return pfs_opens_.load(); }  // copies started from the PFS

 private:
  void work(unsigned tag);
  // One job: from its peer, then from the PFS if that did not give it.
  Done run(const Job& job, std::vector<char>& buffer, unsigned tag);
  CopyResult fetch_from(const PeerAddress& peer, const Job& job, std::vector<char>& buffer,
                        unsigned tag, PeerOutcome* outcome);

  CopyEngine& engine_;
  PeerClient* client_;
  bool verify_;
  std::string stage_dir_;
  const std::atomic<bool>& cancel_;
  std::function<void(const std::string&)> log_;
  std::atomic<uint64_t> pfs_opens_{0}, logged_peer_failures_{0};

  std::mutex peer_mu_;
  std::unordered_set<uint32_t> down_;  // peers not asked again (by node), under peer_mu_
  std::unordered_map<uint32_t, unsigned> bad_replies_;  // by node: failed checks, under peer_mu_

  // Shared between the coordinator and the copy threads, under mu_.
  std::mutex mu_;
  std::condition_variable cv_work_, cv_done_;
  std::deque<Job> jobs_;
  std::vector<Done> done_;
  bool stopping_ = false;
  size_t threads_ = 0;  // how many run (their wake-up rule); set before they start

  std::vector<std::thread> workers_;  // the coordinator's
};

}  // namespace hpcdl
