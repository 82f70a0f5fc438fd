// Copying one file from the PFS into the stage dir: safe directory descent (no symlinks), a
// temporary file in the session directory published with linkat (which never replaces an
// existing file), a manifest record for everything created, kernel copy paths with a read/write
// fallback, optional checksum verification, and the emulated PFS (HPCDL_STAGE_EMULATE_PFS).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "common.h"
#include "manifest.h"

namespace hpcdl {

// Emulated parallel file system: a latency per source open and an aggregate bandwidth cap on
// source reads, shared by all copy threads of this process. Emulation only, for tests/benchmarks.
class PfsEmulation {
 public:
  // Parses "latency_ms=2,mbps=500" (either key optional); throws StageError on a bad value.
  static PfsEmulation parse(const std::string& spec);
  static PfsEmulation from_env();

  bool active() const { return latency_ms_ > 0 || mbps_ > 0; }
  void on_open() const;              // sleeps the open latency
  void on_read(uint64_t bytes);      // sleeps until the bandwidth cap allows `bytes`
  double latency_ms() const { return latency_ms_; }
  double mbps() const { return mbps_; }

  PfsEmulation() = default;
  PfsEmulation(const PfsEmulation& other) : latency_ms_(other.latency_ms_), mbps_(other.mbps_) {}

 private:
  double latency_ms_ = 0;
  double mbps_ = 0;
  std::mutex mu_;
  std::chrono::steady_clock::time_point next_free_{};
};

// The stage directory, opened once; every destination is reached with openat(O_NOFOLLOW) one
// component at a time, so neither a symlinked directory nor a plan entry can lead outside it.
class StageTree {
 public:
  // Directories created here are recorded in `manifest`.
  StageTree(const std::string& root, Manifest& manifest);
  const std::string& root() const { return root_; }

  // Directory fd for `rel_dir` ("" = the root), created with mode 0700 when `create`; -1 when it
  // does not exist and !create. Throws StageError for a symlink or non-directory on the way.
  int dir_for(const std::string& rel_dir, bool create);

 private:
  // One component `name` of the directory `prefix`, under `parent` (made when `create`): its
  // descriptor, or -1 when it does not exist and !create; throws as dir_for. Under mu_.
  int open_component(int parent, const std::string& name, const std::string& prefix,
                     bool create);

  std::string root_;
  Manifest& manifest_;
  UniqueFd root_fd_;
  std::mutex mu_;
  std::unordered_map<std::string, std::unique_ptr<UniqueFd>> dirs_;
  // Directories seen missing by a lookup without `create` (a fresh stage dir: every reuse
  // check would otherwise cost a failing openat); a creating lookup clears the entry.
  std::unordered_set<std::string> missing_;
};

enum class CopyOutcome { Ok, Transient, Failed, NoSpace, Cancelled };

// The staged file a stager published or adopted: only this inode may be evicted.
struct CopyId {
  uint64_t ino = 0, dev = 0;
};

struct CopyResult {
  CopyResult() = default;
  CopyResult(CopyOutcome o, uint64_t b, std::string m, CopyId i)
      : outcome(o), bytes(b), message(std::move(m)), id(i) {}

  CopyOutcome outcome = CopyOutcome::Ok;
  uint64_t bytes = 0;
  std::string message;  // path + strerror + what happens next, when not Ok
  CopyId id;            // when Ok
  bool has_checksum = false;  // FNV-1a 64 of the source's bytes, known with --verify
  uint64_t checksum = 0;
  FileIdentity source_id;     // the source's identity recorded in the manifest, when Ok
};

// The bytes of a source that a copy takes: the whole file, or a piece of a shard (the plan's
// pieces section): [offset, offset + length) of a source of `source_size` bytes. A PFS copy of
// a whole file takes the file as it is when opened (its length and source_size unused).
struct SourceRange {
  uint64_t offset = 0;
  uint64_t length = 0;       // the copy's bytes
  uint64_t source_size = 0;  // the whole source's, as the plan lists it
  bool whole = true;
  static SourceRange file(uint64_t size) { return SourceRange{0, size, size, true}; }
};

// What a source other than the PFS (a peer, peer.h) wrote into a temporary file.
struct Received {
  bool ok = false;
  int err = 0;                // errno of a local write failure (ENOSPC, EDQUOT, ...)
  std::string message;        // why, when not ok
  FileIdentity source_id;     // the PFS original's identity as the sender recorded it
  bool has_checksum = false;  // the source checksum the bytes were checked against
  uint64_t checksum = 0;
};

// Thread-safe: the stager's copy threads call copy() and receive() at once, and its coordinator
// calls reusable() and remove() meanwhile (stager.cpp, NOTE [threads]). Each call keeps its state on its stack and in the
// caller's `buffer`; what the calls share has a lock of its own (StageTree and Manifest each a
// mutex, PfsEmulation's bandwidth clock a mutex) or is read-only after construction (the
// session dir's descriptor, verify, the cancel flag). Two conditions are the callers': calls
// that run at once use different `tag`s (each tag is one temporary file name), and two copies
// to one `dest` at once are settled by publish (linkat never replaces; the manifest decides).
class CopyEngine {
 public:
  // Temporary files are written in `tmp_dir` (the session directory, on the stage dir's file
  // system) and linked to their destination when complete.
  CopyEngine(StageTree& tree, Manifest& manifest, const std::string& tmp_dir, PfsEmulation& pfs,
             bool verify, const std::atomic<bool>& cancel);

  // Copies `source` (the whole file as it is now, or a piece's range of it, which must then be
  // range.source_size bytes) to `dest` (relative to the stage dir); `buffer` is the calling
  // thread's scratch space, `tag` makes its temporary name unique. A file at `dest` that the
  // manifest does not list is never replaced: the copy then FAILS and readers use the PFS.
  CopyResult copy(const std::string& source, const std::string& dest, std::vector<char>& buffer,
                  unsigned tag, const SourceRange& range = SourceRange());

  // Publishes `dest` from bytes that `fill` writes into the temporary file (a peer's copy of
  // `range` of the source) by copy()'s rules: a temporary file in the session dir, the range's
  // length, the source's mtime, a manifest record with the source identity `fill` reports (of
  // the size the range says), linkat.
  CopyResult receive(const std::string& source, const std::string& dest, const SourceRange& range,
                     const std::function<Received(int fd)>& fill, unsigned tag);

  // The copy at `dest` when it may be reused: the manifest lists it as made from `source`, and
  // the source's size, mtime, ctime, inode and device are still the recorded ones (with
  // --verify: or the checksums of both match).
  std::optional<CopyId> reusable(const std::string& source, const std::string& dest,
                                 uint64_t size, std::vector<char>& buffer);

  // Removes `dest` when it is still the file `id`; returns 0 or the errno.
  int remove(const std::string& dest, CopyId id);

  // Removes the file at `dest` when the manifest lists it (hpcdl made it: a piece an earlier
  // job left, never reused); anything else there is left alone. Returns 0 or the errno.
  int discard(const std::string& dest);

 private:
  // The directory of `dest`, created as needed: its descriptor in `dirfd`, or the result to
  // return when it cannot be made.
  std::optional<CopyResult> dest_dir(const std::string& dest, int& dirfd);
  // The existing directory `dir` (relative to the stage dir): its descriptor, or -1 when it is
  // missing or not a directory reached without a symlink.
  int existing_dir(const std::string& dir);

  // This thread's temporary file `tmp` in the session dir, created new (a leftover of a dead
  // copy of the same thread is removed first), in `out`; or the result to return.
  std::optional<CopyResult> open_temp(const std::string& tmp, const std::string& dest_path,
                                      UniqueFd& out);

  // `source` opened into `src` (a regular file; for a piece, of the size its range says), its
  // stat in `st`; or the result to return.
  std::optional<CopyResult> open_source(const std::string& source, const SourceRange& range,
                                        UniqueFd& src, struct stat& st);

  // copy()'s three steps, over bytes [offset, offset + size) of the source. Each returns the
  // result to return, or nothing to go on.
  // The kernel's copy (copy_file_range, else sendfile); counts into `copied`, and turns
  // `kernel` false, with nothing copied, where neither call applies.
  std::optional<CopyResult> kernel_copy(int src, int out, uint64_t offset, uint64_t size,
                                        const std::string& dest_path, uint64_t& copied,
                                        bool& kernel);
  // pread/write through `buffer`: the emulated PFS's pace, the source checksum with verify.
  std::optional<CopyResult> stream_copy(int src, int out, uint64_t offset, uint64_t size,
                                        const std::string& source, const std::string& dest_path,
                                        std::vector<char>& buffer, uint64_t& copied,
                                        Fnv1a64& source_hash);
  // The copy has `size` bytes and, with verify, the source's checksum (read back from `tmp`).
  std::optional<CopyResult> check_copy(const std::string& tmp, const std::string& source,
                                       const std::string& dest_path, uint64_t size,
                                       uint64_t copied, std::vector<char>& buffer,
                                       const Fnv1a64& source_hash);

  // Links the finished temporary file to `dest`; see copy().
  CopyResult publish(const std::string& tmp, int dirfd, const std::string& dest,
                     const std::string& source, const FileIdentity& source_id, CopyId id);

  StageTree& tree_;
  Manifest& manifest_;
  UniqueFd tmp_dir_;
  PfsEmulation& pfs_;
  bool verify_;
  const std::atomic<bool>& cancel_;
};

// Prefix of the copy threads' temporary files in the session directory ("tmp.<thread>").
constexpr const char* kTempPrefix = "tmp.";

// Removes the temporary files a stager left in `session_dir` (one that was SIGKILLed; any other
// exit removes its own). Only regular files named kTempPrefix + digits; a symlink is never
// followed. Returns how many were removed; StageError when the directory cannot be opened.
size_t remove_temporaries(const std::string& session_dir);

// Splits "a/b/c" into ("a/b", "c").
std::pair<std::string, std::string> split_dest(const std::string& dest);


}  // namespace hpcdl
