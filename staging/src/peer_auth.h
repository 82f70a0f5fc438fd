// The peer tier's cryptography, on OpenSSL's libcrypto (docs/staging.md, "Handshake"): fresh
// nonces, HMAC-SHA256 keyed by the job's secret, and a constant-time compare. Nothing here is
// hand-written cryptography; this file only names what peer.cpp uses.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

struct evp_mac_ctx_st;

namespace hpcdl {

constexpr size_t kPeerNonceBytes = 32;
constexpr size_t kPeerMacBytes = 32;
using PeerMac = std::array<unsigned char, kPeerMacBytes>;

// One HMAC-SHA256 computation keyed by `key`; update() any number of times, then finish()
// once. Throws StageError when libcrypto cannot provide HMAC-SHA256.
class Hmac {
 public:
  explicit Hmac(const std::string& key);
  ~Hmac();
  Hmac(const Hmac&) = delete;
  Hmac& operator=(const Hmac&) = delete;

  Hmac& update(const void* data, size_t len);
  template <typename T>
  Hmac& update_value(const T& value) {  // a fixed-size field as it is on the wire
    return update(&value, sizeof value);
  }
  PeerMac finish();

 private:
  evp_mac_ctx_st* ctx_ = nullptr;
};

// `out` (kPeerNonceBytes) from the operating system's CSPRNG through RAND_bytes; throws
// StageError when it has none.
void random_nonce(unsigned char* out);

// Constant time (CRYPTO_memcmp): how long it takes says nothing about where two MACs differ.
bool same_mac(const PeerMac& want, const unsigned char* got);

}  // namespace hpcdl
