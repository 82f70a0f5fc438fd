#include "peer_wire.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "peer.h"

namespace hpcdl {
namespace wire {
namespace {

int remaining_ms(Clock::time_point deadline) {
  const auto left =
      std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left <= 0 ? 0 : static_cast<int>(std::min<int64_t>(left, kPollSliceMs));
}

}  // namespace

PeerMac proof(const std::string& secret, const char* role, const unsigned char* nonces,
              const std::string& address) {
  return Hmac(secret)
      .update(role, std::strlen(role) + 1)
      .update(nonces, 2 * kPeerNonceBytes)
      .update(address.data(), address.size())
      .finish();
}

void start_reply_mac(Hmac& mac, const unsigned char* nonces, uint64_t number, const Request& req,
                     const Reply& reply) {
  const char label[] = "hpcdl-peer reply";
  mac.update(label, sizeof label).update(nonces, 2 * kPeerNonceBytes).update_value(number);
  mac.update_value(req).update_value(reply);
}

int wait_ready(int fd, short events, Clock::time_point deadline, const std::atomic<bool>& stop) {
  for (;;) {
    if (stop.load(std::memory_order_relaxed)) return ECANCELED;
    const int ms = remaining_ms(deadline);
    if (ms == 0 && Clock::now() >= deadline) return ETIMEDOUT;
    struct pollfd p {fd, events, 0};
    const int n = ::poll(&p, 1, ms);
    if (n > 0) return 0;
    if (n < 0 && errno != EINTR) return errno;
  }
}

int send_all(int fd, const void* data, size_t len, Clock::time_point deadline,
             const std::atomic<bool>& stop, bool more) {
  const char* p = static_cast<const char*>(data);
  while (len > 0) {
    const ssize_t n = ::send(fd, p, len, MSG_NOSIGNAL | MSG_DONTWAIT | (more ? MSG_MORE : 0));
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN) return errno;
      if (int err = wait_ready(fd, POLLOUT, deadline, stop)) return err;
      continue;
    }
    p += n;
    len -= static_cast<size_t>(n);
  }
  return 0;
}

int recv_some(int fd, void* data, size_t len, Clock::time_point deadline,
              const std::atomic<bool>& stop, size_t* got, int flags) {
  for (;;) {
    const ssize_t n = ::recv(fd, data, len, MSG_DONTWAIT | flags);
    if (n > 0) {
      *got = static_cast<size_t>(n);
      return 0;
    }
    if (n == 0) return ECONNRESET;
    if (errno == EINTR) continue;
    if (errno != EAGAIN) return errno;
    if (int err = wait_ready(fd, POLLIN, deadline, stop)) return err;
  }
}

int recv_all(int fd, void* data, size_t len, Clock::time_point deadline,
             const std::atomic<bool>& stop) {
  char* p = static_cast<char*>(data);
  while (len > 0) {
    size_t got = 0;
    if (int err = recv_some(fd, p, len, deadline, stop, &got)) return err;
    p += got;
    len -= got;
  }
  return 0;
}

void set_nodelay(int fd) {
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
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

std::string address_text(const struct sockaddr_in& addr) {
  char host[INET_ADDRSTRLEN] = "?";
  ::inet_ntop(AF_INET, &addr.sin_addr, host, sizeof host);
  return std::string(host) + ":" + std::to_string(ntohs(addr.sin_port));
}

int connect_bounded(const std::string& host, uint16_t port, int timeout_ms) {
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
    const int ready = ::poll(&p, 1, timeout_ms);
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
  set_nodelay(fd.get());
  return fd.release();
}

}  // namespace wire
}  // namespace hpcdl
