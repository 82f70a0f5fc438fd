#include "peer.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <iterator>

#include "peer_auth.h"
#include "peer_wire.h"

namespace hpcdl {

using namespace wire;  // this file speaks the wire

std::string read_peer_secret(int fd) {
  std::string line;
  char c = 0;
  while (line.size() <= 2 * kPeerSecretBytes) {
    const ssize_t n = ::read(fd, &c, 1);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0 || c == '\n') break;
    line.push_back(c);
  }
  if (line.size() != 2 * kPeerSecretBytes ||
      line.find_first_not_of("0123456789abcdef") != std::string::npos) {
    throw StageError("--peer expects the job's secret on stdin (" +
                     std::to_string(2 * kPeerSecretBytes) +
                     " lowercase hex digits and a newline); peer staging is off");
  }
  std::string secret(kPeerSecretBytes, '\0');
  for (size_t i = 0; i < kPeerSecretBytes; ++i) {
    secret[i] = static_cast<char>(std::stoi(line.substr(2 * i, 2), nullptr, 16));
  }
  return secret;
}

PeerServer::PeerServer(int listen_fd, std::string secret, StageTree& tree, unsigned threads,
                       std::function<void(const std::string&)> log)
    : listen_(listen_fd), secret_(std::move(secret)), tree_(tree), log_(std::move(log)) {
  // Non-blocking: threads that race for one connection get EAGAIN, not a hang.
  ::fcntl(listen_.get(), F_SETFL, ::fcntl(listen_.get(), F_GETFL) | O_NONBLOCK);
  // The longest accept queue the system allows (its somaxconn), not the leader's 128: a flood
  // of strangers must not fill it between two accepts and drop a real peer's connect.
  ::listen(listen_.get(), SOMAXCONN);
  for (unsigned t = 0; t < std::max(1u, threads); ++t) threads_.emplace_back([this] { serve(); });
}

PeerServer::~PeerServer() {
  stop_.store(true);
  for (auto& t : threads_) t.join();
}

void PeerServer::offer(uint32_t file_id, ServedCopy copy) {
  std::lock_guard<std::mutex> lock(mu_);
  served_[file_id] = std::move(copy);
}

void PeerServer::withdraw(uint32_t file_id) {
  std::lock_guard<std::mutex> lock(mu_);
  served_.erase(file_id);
}

bool PeerServer::lookup(uint32_t file_id, ServedCopy* out) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = served_.find(file_id);
  if (it == served_.end()) return false;
  *out = it->second;
  return true;
}

void PeerServer::refused(const Conn& conn, const std::string& why) {
  bool first_time = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    first_time = refused_.insert(conn.client).second;
  }
  if (first_time) {  // at most once per client address: a stranger cannot flood the log
    log_("refused a peer connection from " + conn.client +
         ": it did not prove the job's secret (" + why + ")");
  }
}

void PeerServer::accept_new() {
  for (size_t accepted = 0; accepted < kPeerAcceptBatch && !stop_.load(); ++accepted) {
    struct sockaddr_in from {}, local {};
    socklen_t len = sizeof from, local_len = sizeof local;
    UniqueFd conn(::accept4(listen_.get(), reinterpret_cast<struct sockaddr*>(&from), &len,
                            SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (!conn.valid()) return;  // none left (another thread took it, or the client gave up)
    set_nodelay(conn.get());
    ::getsockname(conn.get(), reinterpret_cast<struct sockaddr*>(&local), &local_len);
    char host[INET_ADDRSTRLEN] = "?";
    ::inet_ntop(AF_INET, &from.sin_addr, host, sizeof host);
    Conn c;
    c.fd = std::move(conn);
    c.client = host;
    c.address = address_text(local);
    c.since = Clock::now();
    // A real client's hello is usually here already: read now, it queues as greeted, out of
    // the strangers' reach. One that sent nothing yet queues with them.
    if (handshake_step(c)) enqueue(std::move(c));
  }
}

// Into conns_: a full queue of its kind (silent, or greeted and waiting for its proof) closes
// the oldest connection of the address that holds most of that queue, so that a stranger's
// flood from one host evicts its own; beyond 4 * kPeerMaxIdle connections in all, the oldest
// idle one goes first (its client replaces it if it comes back), else the oldest silent one.
void PeerServer::enqueue(Conn c) {
  std::lock_guard<std::mutex> lock(mu_);
  auto close_oldest = [&](auto&& kind) {
    auto found = conns_.end();
    for (auto it = conns_.begin(); it != conns_.end(); ++it) {
      if (kind(*it) && (found == conns_.end() || it->since < found->since)) found = it;
    }
    if (found == conns_.end()) return false;
    conns_.erase(found);
    return true;
  };
  const bool greeted = c.greeted();
  auto same_kind = [&](const Conn& x) { return !x.authenticated && x.greeted() == greeted; };
  for (;;) {
    std::unordered_map<std::string, size_t> held;  // the queue's connections, by address
    const std::string* most = &c.client;
    size_t queued = 0;
    for (const Conn& x : conns_) {
      if (!same_kind(x)) continue;
      ++queued;
      if (++held[x.client] > held[*most]) most = &x.client;
    }
    if (queued < kPeerMaxPending) break;
    const std::string heaviest = *most;
    close_oldest([&](const Conn& x) { return same_kind(x) && x.client == heaviest; });
  }
  if (conns_.size() >= 4 * kPeerMaxIdle &&
      !close_oldest([](const Conn& x) { return x.authenticated; })) {
    close_oldest([](const Conn& x) { return !x.greeted(); });
  }
  c.serial = ++next_serial_;
  conns_.push_back(std::move(c));
}

// Idle connections past kPeerIdleCloseMs and handshakes past the deadline are closed.
void PeerServer::sweep() {
  const auto now = Clock::now();
  std::vector<Conn> late;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto expired = [&](const Conn& c) {
      return c.authenticated ? now - c.since > std::chrono::milliseconds(kPeerIdleCloseMs)
                             : now - c.since > std::chrono::milliseconds(kPeerRequestDeadlineMs);
    };
    auto keep = std::partition(conns_.begin(), conns_.end(), [&](const Conn& c) { return !expired(c); });
    std::move(keep, conns_.end(), std::back_inserter(late));
    conns_.erase(keep, conns_.end());
  }
  for (const Conn& c : late) {
    if (!c.authenticated) refused(c, "no handshake within " + std::to_string(kPeerRequestDeadlineMs / 1000) + " s");
  }
}

bool PeerServer::claim(int fd, uint64_t serial, Conn* out) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = std::find_if(conns_.begin(), conns_.end(), [&](const Conn& c) {
    return c.fd.get() == fd && c.serial == serial;
  });
  if (it == conns_.end()) return false;  // another thread has it
  *out = std::move(*it);
  conns_.erase(it);
  return true;
}

// Every thread polls the listening socket and every connection nobody reads; the one that
// claims a readable connection takes its handshake step or answers its request, and puts it
// back.
void PeerServer::serve() {
  std::vector<char> buffer(1u << 20);  // once per thread, not per request
  std::vector<struct pollfd> fds;
  std::vector<uint64_t> serials;
  while (!stop_.load()) {
    sweep();
    fds.assign(1, pollfd{listen_.get(), POLLIN, 0});
    serials.assign(1, 0);
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const Conn& c : conns_) {
        fds.push_back(pollfd{c.fd.get(), POLLIN, 0});
        serials.push_back(c.serial);
      }
    }
    if (::poll(fds.data(), fds.size(), kPollSliceMs) <= 0) continue;
    if (fds[0].revents & POLLIN) accept_new();
    for (size_t i = 1; i < fds.size() && !stop_.load(); ++i) {
      Conn conn;
      if (fds[i].revents == 0 || !claim(fds[i].fd, serials[i], &conn)) continue;
      if (!conn.authenticated && !handshake_step(conn)) continue;  // closed here
      if (conn.authenticated) {
        char first = 0;  // a request waits (a proof usually comes with the first one)
        const ssize_t n = ::recv(conn.fd.get(), &first, 1, MSG_PEEK | MSG_DONTWAIT);
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) continue;  // closed: done
        if (n > 0 && !answer(conn, buffer)) continue;
        if (n > 0) conn.since = Clock::now();
      }
      std::lock_guard<std::mutex> lock(mu_);
      conns_.push_back(std::move(conn));  // back in: it held its place while claimed
    }
  }
}

// One step of the server's side of the handshake, with what has arrived; never blocks.
bool PeerServer::handshake_step(Conn& conn) {
  const bool proving = conn.have >= kClientHelloBytes;  // the hello is in: its proof comes
  const size_t want = proving ? kClientHelloBytes + kPeerMacBytes : kClientHelloBytes;
  // One buffer: the hello, then (its nonce kept in conn.nonces) the proof.
  const size_t offset = proving ? conn.have - kClientHelloBytes : conn.have;
  const ssize_t n = ::recv(conn.fd.get(), conn.hello + offset, want - conn.have, MSG_DONTWAIT);
  if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
    refused(conn, "it closed the connection during the handshake");
    return false;
  }
  if (n < 0) return true;
  conn.have += static_cast<size_t>(n);
  if (conn.have < want) return true;
  if (!proving) {
    if (std::memcmp(conn.hello, kClientHelloMagic, sizeof kClientHelloMagic) != 0) {
      refused(conn, "not a hello of this protocol");
      return false;
    }
    std::memcpy(conn.nonces, conn.hello + 8, kPeerNonceBytes);
    random_nonce(conn.nonces + kPeerNonceBytes);
    unsigned char hello[kServerHelloBytes];
    std::memcpy(hello, kServerHelloMagic, 8);
    std::memcpy(hello + 8, conn.nonces + kPeerNonceBytes, kPeerNonceBytes);
    const PeerMac mine = proof(secret_, "hpcdl-peer server", conn.nonces, conn.address);
    std::memcpy(hello + 8 + kPeerNonceBytes, mine.data(), kPeerMacBytes);
    // 72 bytes into a new connection's empty send buffer: never more than a moment.
    const auto deadline = Clock::now() + std::chrono::milliseconds(kPeerRequestDeadlineMs);
    return send_all(conn.fd.get(), hello, sizeof hello, deadline, stop_) == 0;
  }
  const PeerMac theirs = proof(secret_, "hpcdl-peer client", conn.nonces, conn.address);
  if (!same_mac(theirs, conn.hello)) {
    refused(conn, "a wrong proof");
    const Reply no = reply_of(kRefused);
    send_all(conn.fd.get(), &no, sizeof no, Clock::now() + std::chrono::milliseconds(kPollSliceMs), stop_);
    return false;
  }
  conn.authenticated = true;
  conn.since = Clock::now();  // from now on the idle clock
  return true;
}

UniqueFd PeerServer::open_served(const Request& req, ServedCopy* copy) {
  const bool want_checksum = (req.flags & kAskChecksum) != 0;
  if (!lookup(req.file_id, copy) || copy->size != req.size ||
      (want_checksum && !copy->has_checksum) || req.offset > copy->size ||
      req.length > copy->size - req.offset) {
    return UniqueFd();
  }
  UniqueFd file;
  const auto [dir, base] = split_dest(copy->dest);
  try {
    const int dirfd = tree_.dir_for(dir, false);
    if (dirfd >= 0) file = UniqueFd(::openat(dirfd, base.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC));
  } catch (const StageError&) {
    // a symlink or non-directory on the way: not served
  }
  // Still the copy we made, whole, and not written since it was published.
  struct stat st {};
  if (file.valid() && (::fstat(file.get(), &st) != 0 || !S_ISREG(st.st_mode) ||
                       static_cast<uint64_t>(st.st_ino) != copy->id.ino ||
                       static_cast<uint64_t>(st.st_dev) != copy->id.dev ||
                       static_cast<uint64_t>(st.st_size) != copy->size ||
                       mtime_ns_of(st) != copy->source_id.mtime_ns)) {
    file.reset();
  }
  return file;
}

bool PeerServer::answer(Conn& conn, std::vector<char>& buffer) {
  const int fd = conn.fd.get();
  const auto started = Clock::now();
  Request req{};
  if (recv_all(fd, &req, sizeof req, started + std::chrono::milliseconds(kPeerRequestDeadlineMs),
               stop_) != 0 ||
      std::memcmp(req.magic, kRequestMagic, sizeof req.magic) != 0) {
    return false;  // an authenticated peer that sends no whole request in time: closed
  }
  const uint64_t number = conn.requests++;
  ServedCopy copy;
  const UniqueFd file = open_served(req, &copy);
  // The range's bytes, at kPeerMinRate at least, after the request's own allowance.
  const auto deadline = started + std::chrono::milliseconds(kPeerRequestDeadlineMs) +
                        std::chrono::milliseconds(file.valid() ? req.length * 1000 / kPeerMinRate : 0);
  if (!file.valid()) {
    const Reply no = reply_of(kNotHere);
    return send_all(fd, &no, sizeof no, deadline, stop_) == 0;
  }
  Reply r = reply_of(kServed);
  r.size = copy.size;
  r.mtime_ns = copy.source_id.mtime_ns;
  r.ctime_ns = copy.source_id.ctime_ns;
  r.ino = copy.source_id.ino;
  r.dev = copy.source_id.dev;
  r.has_checksum = copy.has_checksum ? 1 : 0;
  r.checksum = copy.checksum;
  Hmac mac(secret_);
  start_reply_mac(mac, conn.nonces, number, req, r);
  if (send_all(fd, &r, sizeof r, deadline, stop_, true) != 0) return false;
  for (uint64_t sent = 0; sent < req.length;) {
    const ssize_t n = ::pread(file.get(), buffer.data(), std::min<uint64_t>(req.length - sent, buffer.size()),
                              static_cast<off_t>(req.offset + sent));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;  // truncated meanwhile: the client sees a short reply
    mac.update(buffer.data(), static_cast<size_t>(n));
    if (send_all(fd, buffer.data(), static_cast<size_t>(n), deadline, stop_, true) != 0) return false;
    sent += static_cast<uint64_t>(n);
  }
  const PeerMac tag = mac.finish();
  if (send_all(fd, tag.data(), tag.size(), deadline, stop_) != 0) return false;
  files_served_.fetch_add(1);
  bytes_served_.fetch_add(req.length);
  return true;
}

namespace {

// The client's side of the handshake on a new connection to `address` ("ip:port", as dialed):
// Ok with the nonces in session.nonces and our proof in *ours (sent with the first request),
// or why not. The server proves first, so a squatter learns nothing from us.
PeerFetch client_handshake(PeerClient::Session& session, const std::string& address,
                           const std::string& secret, Clock::time_point deadline,
                           const std::atomic<bool>& cancel, PeerMac* ours) {
  PeerFetch result;
  unsigned char hello[kServerHelloBytes];
  std::memcpy(hello, kClientHelloMagic, 8);
  random_nonce(hello + 8);
  std::memcpy(session.nonces, hello + 8, kPeerNonceBytes);
  int err = send_all(session.fd.get(), hello, kClientHelloBytes, deadline, cancel);
  if (err == 0) err = recv_all(session.fd.get(), hello, kServerHelloBytes, deadline, cancel);
  if (err != 0) {
    result.outcome = err == ECANCELED ? PeerOutcome::Cancelled : PeerOutcome::Unreachable;
    result.err = err;
    result.message = "peer " + address + " did not finish the handshake: " +
                     (err == ETIMEDOUT ? "no answer within the " +
                                             std::to_string(kPeerRequestDeadlineMs / 1000) +
                                             " s deadline"
                                       : errno_text(err));
    return result;
  }
  std::memcpy(session.nonces + kPeerNonceBytes, hello + 8, kPeerNonceBytes);
  const PeerMac want = proof(secret, "hpcdl-peer server", session.nonces, address);
  if (std::memcmp(hello, kServerHelloMagic, 8) != 0 ||
      !same_mac(want, hello + 8 + kPeerNonceBytes)) {
    result.outcome = PeerOutcome::Refused;
    result.message = "peer " + address + " did not prove the job's secret (not this job's "
                     "stager at that address)";
    return result;
  }
  *ours = proof(secret, "hpcdl-peer client", session.nonces, address);
  return result;
}

PeerFetch failed_fetch(PeerOutcome outcome, const std::string& why) {
  PeerFetch result;
  result.outcome = outcome;
  result.message = why;
  return result;
}

// A wait that ended in `err` while `what` (cancelled, or the deadline, or the connection).
PeerFetch lost_fetch(int err, const std::string& peer, const std::string& what, uint64_t bytes) {
  if (err == ECANCELED) return failed_fetch(PeerOutcome::Cancelled, "cancelled");
  const std::string why =
      err == ETIMEDOUT ? "not within its " + std::to_string(kPeerRequestDeadlineMs / 1000) +
                             " s + " + std::to_string(bytes / kPeerMinRate) + " s deadline"
                       : errno_text(err);
  return failed_fetch(PeerOutcome::Unreachable, "peer " + peer + " " + what + " (" + why + ")");
}

// A served reply's `length` bytes (the range asked for) into `out_fd`, then its MAC (started
// over the header by the caller) and with verify the source checksum, all checked.
PeerFetch receive_copy(int fd, const std::string& peer, const Reply& r, uint64_t length,
                       Hmac& mac, bool verify, int out_fd, std::vector<char>& buffer,
                       Clock::time_point deadline, const std::atomic<bool>& cancel) {
  Fnv1a64 got;  // with verify: the source checksum the home recorded
  uint64_t left = length;
  while (left > 0) {
    size_t n = 0;
    const size_t want = static_cast<size_t>(std::min<uint64_t>(left, buffer.size()));
    if (int err = recv_some(fd, buffer.data(), want, deadline, cancel, &n)) {
      const std::string sent = std::to_string(length - left) + " of " + std::to_string(length);
      return lost_fetch(err, peer, "sent " + sent + " bytes", length);
    }
    mac.update(buffer.data(), n);
    if (verify) got.update(buffer.data(), n);
    if (int err = write_all(out_fd, buffer.data(), n)) {
      PeerFetch failed = failed_fetch(PeerOutcome::WriteError, errno_text(err));
      failed.err = err;
      return failed;
    }
    left -= n;
  }
  unsigned char tag[kPeerMacBytes];
  if (int err = recv_all(fd, tag, sizeof tag, deadline, cancel)) {
    return lost_fetch(err, peer, "ended early", length);
  }
  if (!same_mac(mac.finish(), tag)) {
    return failed_fetch(PeerOutcome::Bad,
                        "bytes from peer " + peer + " failed their MAC (damaged or forged)");
  }
  if (verify && got.digest() != r.checksum) {
    return failed_fetch(PeerOutcome::Bad,
                        "the copy on peer " + peer + " differs from its source (checksum)");
  }
  PeerFetch result;
  result.source_id = FileIdentity{r.size, r.mtime_ns, r.ctime_ns, r.ino, r.dev};
  result.has_checksum = r.has_checksum != 0;
  result.checksum = r.checksum;
  return result;
}

// One request and its reply on `session` to `peer`; `ours`: the proof to send first (a new
// connection). *stale: it failed before any byte of a reply came (a pooled connection that the
// peer closed while it was idle).
PeerFetch exchange(PeerClient::Session& session, const std::string& peer,
                   const std::string& secret, const PeerMac* ours, uint32_t file_id,
                   const SourceRange& range, bool verify, int out_fd, std::vector<char>& buffer,
                   Clock::time_point deadline, const std::atomic<bool>& cancel, bool* stale) {
  const int fd = session.fd.get();
  Request req{};
  std::memcpy(req.magic, kRequestMagic, sizeof req.magic);
  req.file_id = file_id;
  req.flags = verify ? kAskChecksum : 0;
  req.size = range.source_size;
  req.offset = range.offset;
  req.length = range.length;
  unsigned char out[kPeerMacBytes + sizeof req];
  size_t len = 0;
  if (ours != nullptr) {
    std::memcpy(out, ours->data(), kPeerMacBytes);
    len = kPeerMacBytes;
  }
  std::memcpy(out + len, &req, sizeof req);
  len += sizeof req;
  const uint64_t number = session.requests++;
  if (int err = send_all(fd, out, len, deadline, cancel)) {
    *stale = err == EPIPE || err == ECONNRESET;
    return lost_fetch(err, peer, "did not take the request", range.length);
  }
  Reply r{};
  size_t peeked = 0;  // the reply's first byte: a pooled connection closed meanwhile fails here
  int err = recv_some(fd, &r, 1, deadline, cancel, &peeked, MSG_PEEK);
  *stale = err == ECONNRESET;
  if (err == 0) err = recv_all(fd, &r, sizeof r, deadline, cancel);
  if (err != 0) return lost_fetch(err, peer, "did not answer", range.length);
  const std::string who = "peer " + peer;
  if (std::memcmp(r.magic, kReplyMagic, sizeof r.magic) != 0) {
    return failed_fetch(PeerOutcome::Bad, who + " answered with a malformed reply");
  }
  if (r.status == kRefused) {
    return failed_fetch(PeerOutcome::Refused, who + " refused our proof of the job's secret");
  }
  if (r.status != kServed) return failed_fetch(PeerOutcome::NotHere, who + " does not hold it");
  if (r.size != req.size) return failed_fetch(PeerOutcome::Bad, who + " offered another size");
  if (verify && !r.has_checksum) return failed_fetch(PeerOutcome::Bad, who + " has no checksum");
  Hmac mac(secret);
  start_reply_mac(mac, session.nonces, number, req, r);
  return receive_copy(fd, peer, r, req.length, mac, verify, out_fd, buffer, deadline, cancel);
}

}  // namespace

PeerClient::Session PeerClient::take(const std::string& key) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& idle = idle_[key];
  const auto too_old = Clock::now() - std::chrono::milliseconds(kPeerIdleReuseMs);
  while (!idle.empty()) {
    Session last = std::move(idle.back());
    idle.pop_back();
    --idle_count_;
    if (last.since >= too_old) return last;
  }
  return Session();
}

void PeerClient::give_back(const std::string& key, Session session) {
  std::lock_guard<std::mutex> lock(mu_);
  if (idle_count_ >= kPeerMaxIdle) return;  // closed: enough descriptors are kept already
  session.since = Clock::now();
  idle_[key].push_back(std::move(session));
  ++idle_count_;
}

namespace {

// A connect's wait: kPeerConnectTimeoutMs, or what is left before the deadline (at least 1 ms).
int connect_wait_ms(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return static_cast<int>(std::clamp<int64_t>(left.count(), 1, kPeerConnectTimeoutMs));
}

// Sleeps `ms`, or less when `cancel` is set or the deadline comes first: false then.
bool back_off(int ms, Clock::time_point deadline, const std::atomic<bool>& cancel) {
  const auto until = Clock::now() + std::chrono::milliseconds(ms);
  if (until >= deadline) return false;
  while (Clock::now() < until) {
    if (cancel.load()) return false;
    std::this_thread::sleep_for(std::min<Clock::duration>(until - Clock::now(),
                                                          std::chrono::milliseconds(kPollSliceMs)));
  }
  return !cancel.load();
}

}  // namespace

PeerFetch PeerClient::open_session(const PeerAddress& peer, const std::string& key,
                                   Session* session, PeerMac* ours, Clock::time_point deadline,
                                   const std::atomic<bool>& cancel) {
  PeerFetch shook;
  for (int tries = 1, wait_ms = kPeerRetryMs;; ++tries, wait_ms *= 4) {
    session->fd = UniqueFd(connect_bounded(peer.host, peer.port, connect_wait_ms(deadline)));
    if (!session->fd.valid()) {
      const int err = errno;
      shook = PeerFetch();
      shook.outcome = PeerOutcome::Unreachable;
      shook.err = err;
      shook.message = "cannot reach peer " + key + ": " + errno_text(err);
    } else {
      opened_.fetch_add(1);
      shook = client_handshake(*session, key, secret_, deadline, cancel, ours);
      if (shook.outcome == PeerOutcome::Ok) return shook;
    }
    // Another try may go better: the home closed or reset the connection (a flood of strangers
    // took its place), or its accept queue was full (refused, or a connect that timed out).
    // A wrong proof is no accident; a handshake that timed out has spent the deadline.
    if (shook.outcome != PeerOutcome::Unreachable) return shook;
    if (tries >= kPeerHandshakeTries || !back_off(wait_ms, deadline, cancel)) {
      shook.message += " (" + std::to_string(tries) + (tries == 1 ? " try" : " tries") + ")";
      return shook;
    }
  }
}

PeerFetch PeerClient::fetch(const PeerAddress& peer, uint32_t file_id, const SourceRange& range,
                            bool verify, int out_fd, std::vector<char>& buffer,
                            const std::atomic<bool>& cancel) {
  const std::string key = peer.host + ":" + std::to_string(peer.port);
  const auto deadline = Clock::now() + std::chrono::milliseconds(kPeerRequestDeadlineMs) +
                        std::chrono::milliseconds(range.length * 1000 / kPeerMinRate);
  for (;;) {
    Session session = take(key);
    const bool reused = session.fd.valid();
    PeerMac ours{};
    if (!reused) {
      PeerFetch shook = open_session(peer, key, &session, &ours, deadline, cancel);
      if (shook.outcome != PeerOutcome::Ok) return shook;
    }
    bool stale = false;
    PeerFetch got = exchange(session, key, secret_, reused ? nullptr : &ours, file_id, range,
                             verify, out_fd, buffer, deadline, cancel, &stale);
    if (reused && stale) continue;  // closed by the peer while idle: again on a new connection
    if (got.outcome == PeerOutcome::Ok || got.outcome == PeerOutcome::NotHere) {
      give_back(key, std::move(session));  // the reply was read whole: the next request may follow
    }
    return got;
  }
}

CopyResult copy_from_peer(CopyEngine& engine, PeerClient& client, const PeerAddress& peer,
                          uint32_t file_id, const SourceRange& range, const std::string& source,
                          const std::string& dest, bool verify, std::vector<char>& buffer,
                          unsigned tag, const std::atomic<bool>& cancel, PeerOutcome* outcome) {
  *outcome = PeerOutcome::Ok;
  auto fill = [&](int fd) {
    const PeerFetch got = client.fetch(peer, file_id, range, verify, fd, buffer, cancel);
    *outcome = got.outcome;
    Received r;
    r.ok = got.outcome == PeerOutcome::Ok;
    r.err = got.outcome == PeerOutcome::WriteError ? got.err : 0;
    r.message = got.message + " (node " + std::to_string(peer.node) + ")";
    r.source_id = got.source_id;
    r.has_checksum = got.has_checksum;
    r.checksum = got.checksum;
    return r;
  };
  CopyResult result = engine.receive(source, dest, range, fill, tag);
  if (result.outcome != CopyOutcome::Ok && *outcome == PeerOutcome::Ok) {
    *outcome = PeerOutcome::Unpublished;  // received whole, but not publishable (size, link)
  }
  return result;
}

}  // namespace hpcdl
