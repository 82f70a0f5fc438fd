#include "peer_auth.h"

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/params.h>
#include <openssl/rand.h>

#include "common.h"

namespace hpcdl {
namespace {

// Fetched once per process: a fetch per MAC would look the algorithm up in the provider
// tables every time.
EVP_MAC* hmac_algorithm() {
  static EVP_MAC* const mac = EVP_MAC_fetch(nullptr, "HMAC", nullptr);
  if (mac == nullptr) {
    throw StageError("OpenSSL's libcrypto provides no HMAC; the peer tier cannot start");
  }
  return mac;
}

}  // namespace

Hmac::Hmac(const std::string& key) : ctx_(EVP_MAC_CTX_new(hmac_algorithm())) {
  char digest[] = "SHA256";
  const OSSL_PARAM params[] = {
      OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest, 0), OSSL_PARAM_END};
  if (ctx_ == nullptr ||
      EVP_MAC_init(ctx_, reinterpret_cast<const unsigned char*>(key.data()), key.size(),
                   params) != 1) {
    EVP_MAC_CTX_free(ctx_);
    throw StageError("OpenSSL cannot compute HMAC-SHA256; the peer tier cannot start");
  }
}

Hmac::~Hmac() { EVP_MAC_CTX_free(ctx_); }

Hmac& Hmac::update(const void* data, size_t len) {
  EVP_MAC_update(ctx_, static_cast<const unsigned char*>(data), len);
  return *this;
}

PeerMac Hmac::finish() {
  PeerMac out{};
  size_t len = 0;
  EVP_MAC_final(ctx_, out.data(), &len, out.size());
  return out;
}

void random_nonce(unsigned char* out) {
  if (RAND_bytes(out, static_cast<int>(kPeerNonceBytes)) != 1) {
    throw StageError("OpenSSL's RAND_bytes has no randomness to give; no peer connection");
  }
}

bool same_mac(const PeerMac& want, const unsigned char* got) {
  return CRYPTO_memcmp(want.data(), got, want.size()) == 0;
}

}  // namespace hpcdl
