// The peer tier's wire (docs/staging.md, "Handshake"): message layouts, the proofs and the
// reply MAC, and socket I/O bounded by a deadline. Shared by the server and the client in
// peer.cpp; nothing here keeps state.
#pragma once

#include <netinet/in.h>
#include <sys/stat.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

#include "peer_auth.h"

namespace hpcdl {
namespace wire {

using Clock = std::chrono::steady_clock;


// Wire format, little-endian (docs/staging.md, "Peer tier" and "Handshake"). A connection opens
// with a client hello (magic, nonce), a server hello (magic, nonce, the server's proof) and the
// client's proof, sent with its first request; then one request after another, each answered
// whole before the next is read.
constexpr char kClientHelloMagic[8] = {'H', 'P', 'C', 'D', 'L', 'P', 'H', '2'};
constexpr char kServerHelloMagic[8] = {'H', 'P', 'C', 'D', 'L', 'P', 'S', '2'};
constexpr char kRequestMagic[8] = {'H', 'P', 'C', 'D', 'L', 'P', 'Q', '3'};
constexpr char kReplyMagic[8] = {'H', 'P', 'C', 'D', 'L', 'P', 'A', '3'};
constexpr uint32_t kAskChecksum = 1;
enum ReplyStatus : uint32_t { kServed = 0, kNotHere = 1, kRefused = 2 };
constexpr size_t kClientHelloBytes = 8 + kPeerNonceBytes;
constexpr size_t kServerHelloBytes = 8 + kPeerNonceBytes + kPeerMacBytes;
constexpr int kPollSliceMs = 100;  // a blocked thread looks at its stop or cancel flag this often

// A request for bytes [offset, offset + length) of file `file_id` (its id in the home's plan)
// of `size` bytes (the fetcher's plan's size of the whole file); a whole file: 0 and size.
struct Request {
  char magic[8];
  uint32_t file_id;
  uint32_t flags;
  uint64_t size;
  uint64_t offset;
  uint64_t length;
};

struct Reply {
  char magic[8];
  uint32_t status;
  uint32_t has_checksum;
  uint64_t size, mtime_ns, ctime_ns, ino, dev, checksum;
};

static_assert(sizeof(Request) == 40 && sizeof(Reply) == 64, "wire structs must not pad");

// The proofs: HMAC-SHA256 keyed by the job's secret over the role, both nonces and the address
// the client dialed. The role keeps one side's proof from serving as the other's (reflection);
// the nonces make each proof good for one connection only (replay); the address keeps a
// stager of the job at one address from vouching for a squatter at another (relay).
PeerMac proof(const std::string& secret, const char* role, const unsigned char* nonces,
              const std::string& address);

// The MAC that a served reply ends with starts over this: the connection's nonces, the
// request's number on it, the request (so its range) and the reply's header; the range's bytes
// follow.
void start_reply_mac(Hmac& mac, const unsigned char* nonces, uint64_t number, const Request& req,
                     const Reply& reply);

// Waits until `fd` is ready for `events`, the deadline passes (ETIMEDOUT) or `stop` is set
// (ECANCELED); 0 when ready.
int wait_ready(int fd, short events, Clock::time_point deadline, const std::atomic<bool>& stop);

// 0, or the errno (ETIMEDOUT past the deadline, ECANCELED on stop, ECONNRESET for a peer that
// closed early). more: more of this reply follows at once (MSG_MORE: one segment for a small
// file's header, bytes and MAC, which TCP_NODELAY would otherwise send as three).
int send_all(int fd, const void* data, size_t len, Clock::time_point deadline,
             const std::atomic<bool>& stop, bool more = false);

// Some bytes (at most len) into data: 0 with *got set, or the errno as send_all's.
int recv_some(int fd, void* data, size_t len, Clock::time_point deadline,
              const std::atomic<bool>& stop, size_t* got, int flags = 0);
int recv_all(int fd, void* data, size_t len, Clock::time_point deadline,
             const std::atomic<bool>& stop);

// No Nagle delay: a connection carries one small request after another, and a request or the
// last segment of a reply held back for a delayed ACK would cost 40 ms.
void set_nodelay(int fd);

Reply reply_of(ReplyStatus status);
uint64_t mtime_ns_of(const struct stat& st);
std::string address_text(const struct sockaddr_in& addr);  // "ip:port"

// Connects with a bounded wait (timeout_ms: kPeerConnectTimeoutMs, or less where a deadline
// comes first); -1 with errno set on failure.
int connect_bounded(const std::string& host, uint16_t port, int timeout_ms);

}  // namespace wire
}  // namespace hpcdl
