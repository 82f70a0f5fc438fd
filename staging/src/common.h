// Small RAII types and error helpers shared by the stager's modules.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

namespace hpcdl {

inline std::string errno_text(int err) { return std::string(std::strerror(err)); }

// All of buf to fd, retrying short and interrupted writes: 0, or the errno. The copy engine's
// and the peer client's one way to write a file.
inline int write_all(int fd, const char* buf, size_t len) {
  while (len > 0) {
    const ssize_t n = ::write(fd, buf, len);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    buf += n;
    len -= static_cast<size_t>(n);
  }
  return 0;
}

// Bytes as a person reads them: "65.1 GiB", "512 B" (binary units, one decimal).
inline std::string human_bytes(uint64_t bytes) {
  static const char* const units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double value = static_cast<double>(bytes);
  size_t unit = 0;
  while (value >= 1024.0 && unit + 1 < sizeof units / sizeof units[0]) {
    value /= 1024.0;
    ++unit;
  }
  char text[32];
  std::snprintf(text, sizeof text, unit == 0 ? "%.0f %s" : "%.1f %s", value, units[unit]);
  return text;
}

// An error that stops the stager; the message already names the path, the errno text and what
// happens next.
class StageError : public std::runtime_error {
 public:
  explicit StageError(const std::string& msg, int err = 0) : std::runtime_error(msg), err_(err) {}
  int err() const { return err_; }

 private:
  int err_;
};

class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd() { reset(); }
  UniqueFd(UniqueFd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) {
      reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() { return std::exchange(fd_, -1); }  // the caller closes it
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

class MappedRegion {
 public:
  MappedRegion() = default;
  MappedRegion(void* addr, size_t len) : addr_(addr), len_(len) {}
  ~MappedRegion() { reset(); }
  MappedRegion(MappedRegion&& other) noexcept
      : addr_(std::exchange(other.addr_, nullptr)), len_(std::exchange(other.len_, 0)) {}
  MappedRegion& operator=(MappedRegion&& other) noexcept {
    if (this != &other) {
      reset();
      addr_ = std::exchange(other.addr_, nullptr);
      len_ = std::exchange(other.len_, 0);
    }
    return *this;
  }
  MappedRegion(const MappedRegion&) = delete;
  MappedRegion& operator=(const MappedRegion&) = delete;

  unsigned char* bytes() const { return static_cast<unsigned char*>(addr_); }
  size_t size() const { return len_; }
  void reset() {
    if (addr_ != nullptr) ::munmap(addr_, len_);
    addr_ = nullptr;
    len_ = 0;
  }

 private:
  void* addr_ = nullptr;
  size_t len_ = 0;
};

// 64-bit FNV-1a: plan hash and --verify checksums (stable, no dependency).
class Fnv1a64 {
 public:
  void update(const void* data, size_t len) {
    const auto* p = static_cast<const unsigned char*>(data);
    for (size_t i = 0; i < len; ++i) {
      h_ ^= p[i];
      h_ *= 1099511628211ULL;
    }
  }
  unsigned long long digest() const { return h_; }

 private:
  unsigned long long h_ = 14695981039346656037ULL;
};

}  // namespace hpcdl
