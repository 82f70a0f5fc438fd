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

namespace hpcdl {
namespace {

// Wire format, little-endian (docs/staging.md, "Peer tier"). A connection carries one request
// after another, each answered whole before the next is read.
constexpr char kRequestMagic[8] = {'H', 'P', 'C', 'D', 'L', 'P', 'Q', '1'};
constexpr char kReplyMagic[8] = {'H', 'P', 'C', 'D', 'L', 'P', 'A', '1'};
constexpr uint32_t kAskChecksum = 1;
enum ReplyStatus : uint32_t { kServed = 0, kNotHere = 1, kRefused = 2 };

struct Request {
  char magic[8];
  unsigned char secret[kPeerSecretBytes];
  uint32_t file_id;
  uint32_t flags;
  uint64_t size;
};

struct Reply {
  char magic[8];
  uint32_t status;
  uint32_t has_checksum;
  uint64_t size, mtime_ns, ctime_ns, ino, dev, checksum;
};

static_assert(sizeof(Request) == 56 && sizeof(Reply) == 64, "wire structs must not pad");

// 0, or the errno (ETIMEDOUT for a receive timeout, ECONNRESET for a peer that closed early).
// more: more of this reply follows at once (MSG_MORE: one segment for a small file's header,
// bytes and trailer, which TCP_NODELAY would otherwise send as three).
int send_all(int fd, const void* data, size_t len, bool more = false) {
  const char* p = static_cast<const char*>(data);
  while (len > 0) {
    const ssize_t n = ::send(fd, p, len, MSG_NOSIGNAL | (more ? MSG_MORE : 0));
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno == EAGAIN ? ETIMEDOUT : errno;
    }
    p += n;
    len -= static_cast<size_t>(n);
  }
  return 0;
}

int recv_all(int fd, void* data, size_t len) {
  char* p = static_cast<char*>(data);
  while (len > 0) {
    const ssize_t n = ::recv(fd, p, len, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno == EAGAIN ? ETIMEDOUT : errno;
    }
    if (n == 0) return ECONNRESET;
    p += n;
    len -= static_cast<size_t>(n);
  }
  return 0;
}

int write_fd(int fd, const char* p, size_t len) {
  while (len > 0) {
    const ssize_t n = ::write(fd, p, len);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    p += n;
    len -= static_cast<size_t>(n);
  }
  return 0;
}

// Bounded waits, and no Nagle delay: a connection carries one small request after another, and
// a request or the last segment of a reply held back for a delayed ACK would cost 40 ms.
void set_io_timeouts(int fd) {
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  struct timeval tv {};
  tv.tv_sec = kPeerIoTimeoutMs / 1000;
  tv.tv_usec = (kPeerIoTimeoutMs % 1000) * 1000;
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

bool same_secret(const unsigned char* got, const std::string& want) {
  unsigned char diff = 0;  // constant time: every byte is compared
  for (size_t i = 0; i < kPeerSecretBytes; ++i) {
    diff |= static_cast<unsigned char>(got[i] ^ static_cast<unsigned char>(want[i]));
  }
  return diff == 0;
}

Reply reply_of(ReplyStatus status) {
  Reply r{};
  std::memcpy(r.magic, kReplyMagic, sizeof r.magic);
  r.status = status;
  return r;
}

uint64_t mtime_ns_of(const struct stat& st) {
  return static_cast<uint64_t>(st.st_mtim.tv_sec) * 1000000000ull +
         static_cast<uint64_t>(st.st_mtim.tv_nsec);
}

// Connects with a bounded wait; -1 with errno set on failure.
int connect_bounded(const std::string& host, uint16_t port) {
  struct sockaddr_in addr {};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  if (::inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
    errno = EINVAL;
    return -1;
  }
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return -1;
  if (::connect(fd.get(), reinterpret_cast<struct sockaddr*>(&addr), sizeof addr) != 0) {
    if (errno != EINPROGRESS) return -1;
    struct pollfd p {fd.get(), POLLOUT, 0};
    const int ready = ::poll(&p, 1, kPeerConnectTimeoutMs);
    int err = 0;
    socklen_t len = sizeof err;
    if (ready == 0) err = ETIMEDOUT;
    else if (ready < 0) err = errno;
    else if (::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
    if (err != 0) {
      errno = err;
      return -1;
    }
  }
  const int flags = ::fcntl(fd.get(), F_GETFL);
  ::fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK);
  set_io_timeouts(fd.get());
  return fd.release();
}

}  // namespace

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

void PeerServer::accept_new() {
  for (;;) {
    struct sockaddr_in from {};
    socklen_t len = sizeof from;
    UniqueFd conn(::accept4(listen_.get(), reinterpret_cast<struct sockaddr*>(&from), &len,
                            SOCK_CLOEXEC));
    if (!conn.valid()) return;  // none left (another thread took it, or the client gave up)
    set_io_timeouts(conn.get());
    char host[INET_ADDRSTRLEN] = "?";
    ::inet_ntop(AF_INET, &from.sin_addr, host, sizeof host);
    std::lock_guard<std::mutex> lock(mu_);
    if (idle_.size() >= 4 * kPeerMaxIdle) {  // its client replaces it if it comes back
      idle_.erase(std::min_element(idle_.begin(), idle_.end(), [](const Conn& a, const Conn& b) {
        return a.idle_since < b.idle_since;
      }));
    }
    idle_.push_back(Conn{std::move(conn), host, ++next_serial_, false,
                         std::chrono::steady_clock::now()});
  }
}

bool PeerServer::claim(int fd, uint64_t serial, Conn* out) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = std::find_if(idle_.begin(), idle_.end(), [&](const Conn& c) {
    return c.fd.get() == fd && c.serial == serial;
  });
  if (it == idle_.end()) return false;  // another thread answers it
  *out = std::move(*it);
  idle_.erase(it);
  return true;
}

// Every thread polls the listening socket and every idle connection; the one that claims a
// readable connection answers its request and puts it back.
void PeerServer::serve() {
  std::vector<char> buffer(1u << 20);  // once per thread, not per request
  std::vector<struct pollfd> fds;
  std::vector<uint64_t> serials;
  while (!stop_.load()) {
    fds.assign(1, pollfd{listen_.get(), POLLIN, 0});
    serials.assign(1, 0);
    {
      std::lock_guard<std::mutex> lock(mu_);
      const auto too_old =
          std::chrono::steady_clock::now() - std::chrono::milliseconds(kPeerIdleCloseMs);
      idle_.erase(std::remove_if(idle_.begin(), idle_.end(),
                                 [&](const Conn& c) { return c.idle_since < too_old; }),
                  idle_.end());
      for (const Conn& c : idle_) {
        fds.push_back(pollfd{c.fd.get(), POLLIN, 0});
        serials.push_back(c.serial);
      }
    }
    if (::poll(fds.data(), fds.size(), 100) <= 0) continue;
    if (fds[0].revents & POLLIN) accept_new();
    for (size_t i = 1; i < fds.size() && !stop_.load(); ++i) {
      Conn conn;
      if (fds[i].revents == 0 || !claim(fds[i].fd, serials[i], &conn)) continue;
      if (!answer(conn, buffer)) continue;  // closed here
      conn.answered = true;
      conn.idle_since = std::chrono::steady_clock::now();
      std::lock_guard<std::mutex> lock(mu_);
      idle_.push_back(std::move(conn));
    }
  }
}

bool PeerServer::answer(Conn& conn, std::vector<char>& buffer) {
  const int fd = conn.fd.get();
  char first = 0;
  // A client that closes a connection it has used is done with it, not refused.
  if (conn.answered && ::recv(fd, &first, 1, MSG_PEEK) <= 0) return false;
  Request req{};
  const int err = recv_all(fd, &req, sizeof req);
  if (err != 0 || std::memcmp(req.magic, kRequestMagic, sizeof req.magic) != 0 ||
      !same_secret(req.secret, secret_)) {
    bool first_time = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      first_time = refused_.insert(conn.client).second;
    }
    if (first_time) {
      log_("refused a peer connection from " + conn.client + ": wrong or missing job secret");
    }
    const Reply no = reply_of(kRefused);
    send_all(fd, &no, sizeof no);
    return false;
  }
  ServedCopy copy;
  const bool want_checksum = (req.flags & kAskChecksum) != 0;
  UniqueFd file;
  struct stat st {};
  if (lookup(req.file_id, &copy) && copy.size == req.size &&
      (!want_checksum || copy.has_checksum)) {
    const auto [dir, base] = split_dest(copy.dest);
    try {
      const int dirfd = tree_.dir_for(dir, false);
      if (dirfd >= 0) file = UniqueFd(::openat(dirfd, base.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC));
    } catch (const StageError&) {
      // a symlink or non-directory on the way: not served
    }
    // Still the copy we made, whole, and not written since it was published.
    if (file.valid() && (::fstat(file.get(), &st) != 0 || !S_ISREG(st.st_mode) ||
                         static_cast<uint64_t>(st.st_ino) != copy.id.ino ||
                         static_cast<uint64_t>(st.st_dev) != copy.id.dev ||
                         static_cast<uint64_t>(st.st_size) != copy.size ||
                         mtime_ns_of(st) != copy.source_id.mtime_ns)) {
      file.reset();
    }
  }
  if (!file.valid()) {
    const Reply no = reply_of(kNotHere);
    return send_all(fd, &no, sizeof no) == 0;
  }
  Reply r = reply_of(kServed);
  r.size = copy.size;
  r.mtime_ns = copy.source_id.mtime_ns;
  r.ctime_ns = copy.source_id.ctime_ns;
  r.ino = copy.source_id.ino;
  r.dev = copy.source_id.dev;
  r.has_checksum = copy.has_checksum ? 1 : 0;
  r.checksum = copy.checksum;
  if (send_all(fd, &r, sizeof r, true) != 0) return false;
  Fnv1a64 sent;
  uint64_t left = copy.size;
  while (left > 0) {
    const ssize_t n = ::read(file.get(), buffer.data(), std::min<uint64_t>(left, buffer.size()));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;  // truncated meanwhile: the client sees a short reply
    sent.update(buffer.data(), static_cast<size_t>(n));
    if (send_all(fd, buffer.data(), static_cast<size_t>(n), true) != 0) return false;
    left -= static_cast<uint64_t>(n);
  }
  const uint64_t digest = sent.digest();
  if (send_all(fd, &digest, sizeof digest) != 0) return false;
  files_served_.fetch_add(1);
  bytes_served_.fetch_add(copy.size);
  return true;
}

namespace {

// One request and its reply on connection `fd` to `peer`. *stale: it failed before any byte of
// a reply came (a pooled connection that the peer closed while it was idle).
PeerFetch exchange(int fd, const std::string& peer, const std::string& secret, uint32_t file_id,
                   uint64_t size, bool verify, int out_fd, std::vector<char>& buffer,
                   const std::atomic<bool>& cancel, bool* stale) {
  PeerFetch result;
  auto fail = [&](PeerOutcome outcome, const std::string& why) {
    result.outcome = outcome;
    result.message = why;
    return result;
  };
  Request req{};
  std::memcpy(req.magic, kRequestMagic, sizeof req.magic);
  std::memcpy(req.secret, secret.data(), std::min(secret.size(), kPeerSecretBytes));
  req.file_id = file_id;
  req.flags = verify ? kAskChecksum : 0;
  req.size = size;
  Reply r{};
  if (int err = send_all(fd, &req, sizeof req)) {
    *stale = err == EPIPE || err == ECONNRESET;
    return fail(PeerOutcome::Unreachable, "peer " + peer + ": " + errno_text(err));
  }
  ssize_t peeked = 0;  // the reply's first byte, within the I/O timeout (not twice it)
  do {
    peeked = ::recv(fd, &r, 1, MSG_PEEK);
  } while (peeked < 0 && errno == EINTR);
  if (peeked <= 0) {
    const int err = peeked == 0 ? ECONNRESET : errno == EAGAIN ? ETIMEDOUT : errno;
    *stale = err == ECONNRESET;
    return fail(PeerOutcome::Unreachable, "peer " + peer + " did not answer: " + errno_text(err));
  }
  if (int err = recv_all(fd, &r, sizeof r)) {
    return fail(PeerOutcome::Unreachable, "peer " + peer + " did not answer: " + errno_text(err));
  }
  if (std::memcmp(r.magic, kReplyMagic, sizeof r.magic) != 0) {
    return fail(PeerOutcome::Bad, "peer " + peer + " answered with a malformed reply");
  }
  if (r.status == kRefused) return fail(PeerOutcome::Refused, "peer " + peer + " refused the job's secret");
  if (r.status != kServed) return fail(PeerOutcome::NotHere, "peer " + peer + " does not hold it");
  if (r.size != size) return fail(PeerOutcome::Bad, "peer " + peer + " offered a copy of another size");
  if (verify && !r.has_checksum) return fail(PeerOutcome::Bad, "peer " + peer + " has no checksum");
  Fnv1a64 got;
  uint64_t left = size;
  while (left > 0) {
    if (cancel.load(std::memory_order_relaxed)) return fail(PeerOutcome::Cancelled, "cancelled");
    const size_t want = static_cast<size_t>(std::min<uint64_t>(left, buffer.size()));
    const ssize_t n = ::recv(fd, buffer.data(), want, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const std::string why = n == 0 ? "closed the connection" : errno_text(errno == EAGAIN ? ETIMEDOUT : errno);
      return fail(PeerOutcome::Unreachable, "peer " + peer + " sent " + std::to_string(size - left) +
                                                " of " + std::to_string(size) + " bytes (" + why + ")");
    }
    got.update(buffer.data(), static_cast<size_t>(n));
    if (int err = write_fd(out_fd, buffer.data(), static_cast<size_t>(n))) {
      result.err = err;
      return fail(PeerOutcome::WriteError, errno_text(err));
    }
    left -= static_cast<uint64_t>(n);
  }
  uint64_t trailer = 0;
  if (int err = recv_all(fd, &trailer, sizeof trailer)) {
    return fail(PeerOutcome::Unreachable, "peer " + peer + " ended early: " + errno_text(err));
  }
  if (trailer != got.digest()) return fail(PeerOutcome::Bad, "bytes from peer " + peer + " were damaged in transit");
  if (verify && got.digest() != r.checksum) {
    return fail(PeerOutcome::Bad, "the copy on peer " + peer + " differs from its source (checksum)");
  }
  result.source_id = FileIdentity{r.size, r.mtime_ns, r.ctime_ns, r.ino, r.dev};
  result.has_checksum = r.has_checksum != 0;
  result.checksum = r.checksum;
  return result;
}

}  // namespace

UniqueFd PeerClient::take(const std::string& key) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& idle = idle_[key];
  const auto too_old =
      std::chrono::steady_clock::now() - std::chrono::milliseconds(kPeerIdleReuseMs);
  while (!idle.empty()) {
    Idle last = std::move(idle.back());
    idle.pop_back();
    --idle_count_;
    if (last.since >= too_old) return std::move(last.fd);
  }
  return UniqueFd();
}

void PeerClient::give_back(const std::string& key, UniqueFd fd) {
  std::lock_guard<std::mutex> lock(mu_);
  if (idle_count_ >= kPeerMaxIdle) return;  // closed: enough descriptors are kept already
  idle_[key].push_back(Idle{std::move(fd), std::chrono::steady_clock::now()});
  ++idle_count_;
}

PeerFetch PeerClient::fetch(const PeerAddress& peer, uint32_t file_id, uint64_t size, bool verify,
                            int out_fd, std::vector<char>& buffer,
                            const std::atomic<bool>& cancel) {
  const std::string key = peer.host + ":" + std::to_string(peer.port);
  for (;;) {
    UniqueFd conn = take(key);
    const bool reused = conn.valid();
    if (!reused) {
      conn = UniqueFd(connect_bounded(peer.host, peer.port));
      if (!conn.valid()) {
        PeerFetch failed;
        failed.outcome = PeerOutcome::Unreachable;
        failed.message = "cannot reach peer " + key + ": " + errno_text(errno);
        return failed;
      }
      opened_.fetch_add(1);
    }
    bool stale = false;
    PeerFetch got =
        exchange(conn.get(), key, secret_, file_id, size, verify, out_fd, buffer, cancel, &stale);
    if (reused && stale) continue;  // closed by the peer while idle: again on a new connection
    if (got.outcome == PeerOutcome::Ok || got.outcome == PeerOutcome::NotHere) {
      give_back(key, std::move(conn));  // the reply was read whole: the next request may follow
    }
    return got;
  }
}

CopyResult copy_from_peer(CopyEngine& engine, PeerClient& client, const PeerAddress& peer,
                          uint32_t file_id, uint64_t size, const std::string& source,
                          const std::string& dest, bool verify, std::vector<char>& buffer,
                          unsigned tag, const std::atomic<bool>& cancel, PeerOutcome* outcome) {
  *outcome = PeerOutcome::Ok;
  auto fill = [&](int fd) {
    const PeerFetch got = client.fetch(peer, file_id, size, verify, fd, buffer, cancel);
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
  CopyResult result = engine.receive(source, dest, size, fill, tag);
  if (result.outcome != CopyOutcome::Ok && *outcome == PeerOutcome::Ok) {
    *outcome = PeerOutcome::Bad;  // received whole, but not publishable (size, link)
  }
  return result;
}

}  // namespace hpcdl
