// The peer tier: stagers of one job serve each other's staged copies over TCP (docs/staging.md,
// "Peer tier"); a connection carries one request after another. Each connection starts with a
// handshake in which both sides prove knowledge of the job's secret (never sent) over fresh
// nonces, the server first; every reply's bytes carry a MAC keyed by the secret. The server
// answers only with a READY copy of its plan that this stager published or adopted, opened
// inside the stage dir without following symlinks, whose size and mtime are still the source's.
// The client writes what it receives to a file descriptor and checks it; the copy engine
// publishes it by the rules of any staged copy. Any failure is the caller's cue to read the PFS.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "common.h"
#include "copy_engine.h"
#include "manifest.h"
#include "peer_wire.h"
#include "plan.h"

namespace hpcdl {

constexpr size_t kPeerSecretBytes = 32;
constexpr int kPeerConnectTimeoutMs = 2000;  // a dead node: then the PFS
// S: a server gives a connection this long from its accept to a finished handshake, and an
// authenticated one this long for each whole request; a fetch gets this long plus the bytes it
// asks for (a range's length) at kPeerMinRate for the whole of it (connect, handshake, reply,
// bytes, MAC).
constexpr int kPeerRequestDeadlineMs = 5000;
constexpr uint64_t kPeerMinRate = 1u << 20;  // bytes/s: a peer slower than this is given up
constexpr unsigned kPeerServeThreads = 4;    // serving threads per stager
// Handshakes in progress, two queues: at most kPeerMaxPending connections that have not sent a
// whole hello (the oldest of them makes room for a new one), and at most kPeerMaxPending that
// sent a valid hello and wait for their proof (the oldest of those makes room for one more of
// them). A flood of silent strangers evicts only its own kind, never a real peer whose hello is
// in: a real client sends its hello with its connect, and the server reads it at the accept.
constexpr size_t kPeerMaxPending = 64;
constexpr size_t kPeerAcceptBatch = 256;     // a thread accepts at most this many, then serves
// A fetcher's connect and handshake: a try that fails (reset, closed or refused by a home busy
// with strangers, or a connect that timed out in its full accept queue) is tried again after
// kPeerRetryMs, then 4x that, within the fetch's deadline (each connect waits at most
// kPeerConnectTimeoutMs, and never past it; a handshake that timed out has spent it); after
// kPeerHandshakeTries the home is down for the run (one line).
constexpr int kPeerHandshakeTries = 3;
constexpr int kPeerRetryMs = 50;
// Replies that fail their check (the MAC, the source checksum, a malformed header) after which
// a peer is down for the run (one line naming it): a damaged or forging peer costs a few
// fetches, not one per file.
constexpr unsigned kPeerMaxBadReplies = 3;
constexpr int kPeerIdleCloseMs = 60000;      // the server closes a connection idle this long
constexpr int kPeerIdleReuseMs = 30000;      // the client reuses one idle at most this long
// Idle connections kept, so that descriptors stay bounded at 1,024 nodes (a node fetches from
// every other one): the client pools at most this many over all its peers, and the server
// closes its oldest idle connection to accept one beyond four times that.
constexpr size_t kPeerMaxIdle = 64;

// Reads the job's secret: one line of 2 * kPeerSecretBytes hex digits on `fd` (the stager's
// stdin, a pipe from the node leader). Throws StageError when it is not that.
std::string read_peer_secret(int fd);

// A copy this stager may serve, as the coordinator publishes it.
struct ServedCopy {
  std::string dest;          // relative to the stage dir
  uint64_t size = 0;         // the plan's size
  FileIdentity source_id;    // the PFS original's identity, as the manifest recorded it
  CopyId id;                 // the staged file's inode and device
  bool has_checksum = false; // FNV-1a 64 of the source, known when copied with --verify
  uint64_t checksum = 0;
};

class PeerServer {
 public:
  // Serves on `listen_fd` (a bound, listening TCP socket handed over by the node leader; this
  // object owns it) with `threads` threads. `log` receives one line per event worth a line.
  // Threads: each one polls the listening socket and every connection; a handshake step only
  // reads what has arrived (never blocks), so strangers never hold a serving thread; a thread
  // blocks only for an authenticated request, at most kPeerRequestDeadlineMs plus its reply's
  // bytes at kPeerMinRate. The thread that accepts a connection takes its first handshake step
  // before it queues it (outside mu_: nobody else knows it yet). mu_ guards served_, refused_,
  // conns_ and next_serial_.
  PeerServer(int listen_fd, std::string secret, StageTree& tree, unsigned threads,
             std::function<void(const std::string&)> log);
  ~PeerServer();
  PeerServer(const PeerServer&) = delete;
  PeerServer& operator=(const PeerServer&) = delete;

  void offer(uint32_t file_id, ServedCopy copy);  // READY: may be served
  void withdraw(uint32_t file_id);                // evicted or replaced: no longer served
  uint64_t files_served() const { return files_served_.load(); }
  uint64_t bytes_served() const { return bytes_served_.load(); }

 private:
  // An accepted connection: in conns_ while nobody reads it, owned by one thread while it
  // takes a handshake step or answers a request. `serial` tells a connection from a later one
  // that reuses its descriptor.
  struct Conn {
    UniqueFd fd;
    std::string client;   // the peer's address (for the log)
    std::string address;  // ours as the client dialed it ("ip:port"), which the proofs name
    uint64_t serial = 0;
    bool authenticated = false;
    bool greeted() const { return have >= wire::kClientHelloBytes; }  // its hello was valid
    unsigned char hello[40] = {};  // the handshake's bytes so far (a hello, then a proof)
    size_t have = 0;
    unsigned char nonces[64] = {};  // the client's, then ours
    uint64_t requests = 0;          // answered on this connection (bound into each reply's MAC)
    std::chrono::steady_clock::time_point since;  // accepted (pending) or last answered (idle)
  };
  void serve();
  void accept_new();
  void enqueue(Conn conn);  // into conns_, evicting by the kPeerMaxPending rules
  void sweep();
  bool claim(int fd, uint64_t serial, Conn* out);
  bool handshake_step(Conn& conn);                     // false: close the connection
  bool answer(Conn& conn, std::vector<char>& buffer);  // false: close the connection
  bool lookup(uint32_t file_id, ServedCopy* out);
  // The file a request asks for, opened, when it may be served (its copy in *copy) and the
  // range lies within it; else none.
  UniqueFd open_served(const wire::Request& req, ServedCopy* copy);
  void refused(const Conn& conn, const std::string& why);

  UniqueFd listen_;
  std::string secret_;
  StageTree& tree_;
  std::function<void(const std::string&)> log_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> files_served_{0}, bytes_served_{0};
  std::mutex mu_;
  std::unordered_map<uint32_t, ServedCopy> served_;
  std::unordered_set<std::string> refused_;  // client addresses already logged
  std::vector<Conn> conns_;  // connections nobody reads now: handshakes and idle ones
  uint64_t next_serial_ = 0;
  std::vector<std::thread> threads_;
};

// Bad: the peer's reply failed a check (counts against it, kPeerMaxBadReplies); Unpublished:
// received whole and checked, but this node could not publish it (not the peer's fault).
enum class PeerOutcome {
  Ok, NotHere, Refused, Unreachable, Bad, Unpublished, Cancelled, WriteError
};

struct PeerFetch {
  PeerOutcome outcome = PeerOutcome::Ok;
  FileIdentity source_id;    // the home's record of the PFS original
  bool has_checksum = false; // with verify: the source checksum the bytes matched
  uint64_t checksum = 0;
  int err = 0;               // errno of a WriteError, or of an Unreachable connect or handshake
  std::string message;       // why, when not Ok
};

// The fetching side: connections to peers kept open between fetches, one idle pool per peer
// address, so that a later epoch's fetches cost a request each and not a TCP handshake and
// teardown each. A connection goes back to the pool only after a whole, checked reply (or a
// "not here"); any fault closes it. Thread-safe.
class PeerClient {
 public:
  explicit PeerClient(std::string secret) : secret_(std::move(secret)) {}

  // Fetches `range` of file `file_id` (of range.source_size bytes) from `peer` into `out_fd`
  // (at its current offset). verify (whole files only: the home holds the checksum of the
  // whole source): ask for the source checksum and compare the received bytes with it. Never
  // waits more than kPeerRequestDeadlineMs plus the range's length at kPeerMinRate in all (a
  // pooled connection
  // the peer has closed is replaced by a new one, before any byte is written; a new one whose
  // connect or handshake fails fast is tried again, kPeerHandshakeTries in all, within that
  // deadline), and notices `cancel` within 100 ms.
  PeerFetch fetch(const PeerAddress& peer, uint32_t file_id, const SourceRange& range,
                  bool verify, int out_fd, std::vector<char>& buffer,
                  const std::atomic<bool>& cancel);
  uint64_t connections_opened() const { return opened_.load(); }

  // An authenticated connection: its descriptor, the handshake's nonces and the requests it
  // has carried (both bound into each reply's MAC).
  struct Session {
    UniqueFd fd;
    unsigned char nonces[64] = {};
    uint64_t requests = 0;
    std::chrono::steady_clock::time_point since;  // pooled at
  };

 private:
  Session take(const std::string& key);  // an idle session to key, or one without a descriptor
  // A new authenticated-to-be session to peer `key`: connected and through the server's half of
  // the handshake (our proof in *ours), tried again by the kPeerHandshakeTries rule; else why.
  PeerFetch open_session(const PeerAddress& peer, const std::string& key, Session* session,
                         PeerMac* ours, std::chrono::steady_clock::time_point deadline,
                         const std::atomic<bool>& cancel);
  void give_back(const std::string& key, Session session);

  std::string secret_;
  std::mutex mu_;
  std::unordered_map<std::string, std::vector<Session>> idle_;
  size_t idle_count_ = 0;  // over all peers, under mu_
  std::atomic<uint64_t> opened_{0};
};

// PeerClient::fetch through `engine`: the copy is published at `dest` by the rules of any staged
// copy (CopyEngine::receive). `outcome` receives how the peer answered (Ok when published).
CopyResult copy_from_peer(CopyEngine& engine, PeerClient& client, const PeerAddress& peer,
                          uint32_t file_id, const SourceRange& range, const std::string& source,
                          const std::string& dest, bool verify, std::vector<char>& buffer,
                          unsigned tag, const std::atomic<bool>& cancel, PeerOutcome* outcome);

}  // namespace hpcdl
