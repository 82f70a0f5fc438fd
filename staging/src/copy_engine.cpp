#include "copy_engine.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/sendfile.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <thread>

namespace hpcdl {
namespace {

constexpr size_t kKernelChunk = 16u << 20;  // bytes per copy_file_range/sendfile call

bool is_transient(int err) {
  return err == EINTR || err == EAGAIN || err == EIO || err == ETIMEDOUT || err == ESTALE ||
         err == EBUSY || err == ENOMEM || err == EMFILE || err == ENFILE;
}

bool is_nospace(int err) { return err == ENOSPC || err == EDQUOT; }

CopyResult error_result(int err, const std::string& what, const std::string& path) {
  CopyResult r;
  if (is_nospace(err)) {
    r.outcome = CopyOutcome::NoSpace;
    r.message = what + " " + path + ": " + errno_text(err) +
                "; staging stops growing, the remaining files are read from the PFS";
  } else if (is_transient(err)) {
    r.outcome = CopyOutcome::Transient;
    r.message = what + " " + path + ": " + errno_text(err) + "; retrying";
  } else {
    r.outcome = CopyOutcome::Failed;
    r.message = what + " " + path + ": " + errno_text(err) +
                "; marked FAILED, readers use the PFS copy";
  }
  return r;
}

uint64_t hash_fd(int fd, std::vector<char>& buffer, int* err) {
  Fnv1a64 h;
  off_t off = 0;
  for (;;) {
    ssize_t n = ::pread(fd, buffer.data(), buffer.size(), off);
    if (n < 0) {
      if (errno == EINTR) continue;
      *err = errno;
      return 0;
    }
    if (n == 0) break;
    h.update(buffer.data(), static_cast<size_t>(n));
    off += n;
  }
  *err = 0;
  return h.digest();
}

// Unlinks a copy thread's temporary name in the session dir when it goes out of scope.
struct TempGuard {
  int dirfd;
  const std::string& name;
  ~TempGuard() { ::unlinkat(dirfd, name.c_str(), 0); }
};

}  // namespace

// ---------------------------------------------------------------- emulated PFS

PfsEmulation PfsEmulation::parse(const std::string& spec) {
  PfsEmulation pfs;
  size_t start = 0;
  while (start < spec.size()) {
    size_t comma = spec.find(',', start);
    std::string item = spec.substr(start, comma == std::string::npos ? std::string::npos
                                                                      : comma - start);
    start = comma == std::string::npos ? spec.size() : comma + 1;
    if (item.empty()) continue;
    size_t eq = item.find('=');
    std::string key = item.substr(0, eq);
    char* end = nullptr;
    double value = eq == std::string::npos ? -1 : std::strtod(item.c_str() + eq + 1, &end);
    if (eq == std::string::npos || end == nullptr || *end != '\0' || value < 0) {
      throw StageError("HPCDL_STAGE_EMULATE_PFS: bad item '" + item +
                       "' (expected latency_ms=X,mbps=Y); the stager does not start");
    }
    if (key == "latency_ms") {
      pfs.latency_ms_ = value;
    } else if (key == "mbps") {
      pfs.mbps_ = value;
    } else {
      throw StageError("HPCDL_STAGE_EMULATE_PFS: unknown key '" + key +
                       "' (expected latency_ms, mbps); the stager does not start");
    }
  }
  return pfs;
}

PfsEmulation PfsEmulation::from_env() {
  const char* spec = std::getenv("HPCDL_STAGE_EMULATE_PFS");
  return spec == nullptr ? PfsEmulation() : parse(spec);
}

void PfsEmulation::on_open() const {
  if (latency_ms_ > 0) {
    std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(latency_ms_));
  }
}

void PfsEmulation::on_read(uint64_t bytes) {
  if (mbps_ <= 0) return;
  const auto cost = std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double>(static_cast<double>(bytes) / (mbps_ * 1e6)));
  std::chrono::steady_clock::time_point done;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto now = std::chrono::steady_clock::now();
    next_free_ = std::max(next_free_, now) + cost;
    done = next_free_;
  }
  std::this_thread::sleep_until(done);
}

// ---------------------------------------------------------------- stage tree

StageTree::StageTree(const std::string& root, Manifest& manifest)
    : root_(root), manifest_(manifest) {
  root_fd_ = UniqueFd(::open(root.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!root_fd_.valid()) {
    int err = errno;
    throw StageError("cannot open stage dir " + root + ": " + errno_text(err) +
                         "; the stager does not start and training reads from the PFS",
                     err);
  }
}

int StageTree::dir_for(const std::string& rel_dir, bool create) {
  std::lock_guard<std::mutex> lock(mu_);
  if (rel_dir.empty()) return root_fd_.get();
  auto found = dirs_.find(rel_dir);
  if (found != dirs_.end()) return found->second->get();
  if (create) {
    missing_.erase(rel_dir);
  } else if (missing_.count(rel_dir)) {
    return -1;
  }

  int parent = root_fd_.get();
  size_t start = 0;
  for (;;) {
    size_t slash = rel_dir.find('/', start);
    const std::string prefix = rel_dir.substr(0, slash);
    const std::string name =
        rel_dir.substr(start, slash == std::string::npos ? std::string::npos : slash - start);
    auto it = dirs_.find(prefix);
    if (it == dirs_.end()) {
      const int fd = open_component(parent, name, prefix, create);
      if (fd < 0) {
        missing_.insert(rel_dir);
        return -1;
      }
      it = dirs_.emplace(prefix, std::make_unique<UniqueFd>(fd)).first;
    }
    parent = it->second->get();
    if (slash == std::string::npos) return parent;
    start = slash + 1;
  }
}

int StageTree::open_component(int parent, const std::string& name, const std::string& prefix,
                              bool create) {
  int fd = ::openat(parent, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0 && errno == ENOENT && create) {
    const bool made = ::mkdirat(parent, name.c_str(), 0700) == 0;
    if (!made && errno != EEXIST) {
      int err = errno;
      throw StageError("cannot create directory " + root_ + "/" + prefix + ": " +
                           errno_text(err) + "; its files are read from the PFS",
                       err);
    }
    fd = ::openat(parent, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    struct stat st {};
    if (made && fd >= 0 && ::fstat(fd, &st) == 0) {  // ours: clean-up may remove it
      ManifestRecord r;
      r.kind = 'd';
      r.dest = prefix;
      r.copy_ino = static_cast<uint64_t>(st.st_ino);
      r.copy_dev = static_cast<uint64_t>(st.st_dev);
      manifest_.append(r);
    }
  }
  if (fd >= 0) return fd;
  int err = errno;
  if (err == ENOENT && !create) return -1;
  if (err == ELOOP || err == ENOTDIR) {
    throw StageError("rejected " + root_ + "/" + prefix +
                         ": a symlink or non-directory inside the stage dir (" +
                         errno_text(err) + "); nothing is written through it, its files "
                         "are read from the PFS",
                     err);
  }
  throw StageError("cannot open directory " + root_ + "/" + prefix + ": " + errno_text(err) +
                       "; its files are read from the PFS",
                   err);
}

// ---------------------------------------------------------------- copy engine

std::pair<std::string, std::string> split_dest(const std::string& dest) {
  size_t slash = dest.rfind('/');
  if (slash == std::string::npos) return {"", dest};
  return {dest.substr(0, slash), dest.substr(slash + 1)};
}

size_t remove_temporaries(const std::string& session_dir) {
  UniqueFd dir(::open(session_dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (!dir.valid()) {
    int err = errno;
    throw StageError("cannot open session directory " + session_dir + ": " + errno_text(err), err);
  }
  DIR* listing = ::fdopendir(::dup(dir.get()));
  if (listing == nullptr) {
    int err = errno;
    throw StageError("cannot list session directory " + session_dir + ": " + errno_text(err), err);
  }
  std::vector<std::string> names;
  const std::string prefix = kTempPrefix;
  while (const struct dirent* entry = ::readdir(listing)) {
    const std::string name = entry->d_name;
    if (name.size() > prefix.size() && name.compare(0, prefix.size(), prefix) == 0 &&
        name.find_first_not_of("0123456789", prefix.size()) == std::string::npos) {
      names.push_back(name);
    }
  }
  ::closedir(listing);
  size_t removed = 0;
  for (const auto& name : names) {
    struct stat st {};
    if (::fstatat(dir.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode) &&
        ::unlinkat(dir.get(), name.c_str(), 0) == 0) {
      ++removed;
    }
  }
  return removed;
}

CopyEngine::CopyEngine(StageTree& tree, Manifest& manifest, const std::string& tmp_dir,
                       PfsEmulation& pfs, bool verify, const std::atomic<bool>& cancel)
    : tree_(tree),
      manifest_(manifest),
      tmp_dir_(::open(tmp_dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)),
      pfs_(pfs),
      verify_(verify),
      cancel_(cancel) {
  if (!tmp_dir_.valid()) {
    int err = errno;
    throw StageError("cannot open session directory " + tmp_dir + ": " + errno_text(err) +
                         "; the stager does not start and training reads from the PFS",
                     err);
  }
}

std::optional<CopyResult> CopyEngine::dest_dir(const std::string& dest, int& dirfd) {
  try {
    dirfd = tree_.dir_for(split_dest(dest).first, true);
    return std::nullopt;
  } catch (const StageError& e) {
    CopyResult r = error_result(e.err() ? e.err() : ENOTDIR, "cannot create directory for",
                                tree_.root() + "/" + dest);
    if (r.outcome != CopyOutcome::NoSpace) r.outcome = CopyOutcome::Failed;
    r.message = e.what();
    return r;
  }
}

std::optional<CopyResult> CopyEngine::open_temp(const std::string& tmp,
                                                const std::string& dest_path, UniqueFd& out) {
  ::unlinkat(tmp_dir_.get(), tmp.c_str(), 0);
  out = UniqueFd(::openat(tmp_dir_.get(), tmp.c_str(),
                          O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
  if (!out.valid()) return error_result(errno, "cannot create a temporary file for", dest_path);
  return std::nullopt;
}

std::optional<CopyResult> CopyEngine::open_source(const std::string& source,
                                                  const SourceRange& range, UniqueFd& src,
                                                  struct stat& st) {
  pfs_.on_open();
  src = UniqueFd(::open(source.c_str(), O_RDONLY | O_CLOEXEC));
  if (!src.valid()) return error_result(errno, "cannot open source", source);
  if (::fstat(src.get(), &st) != 0) return error_result(errno, "cannot stat source", source);
  if (!S_ISREG(st.st_mode)) return error_result(EISDIR, "source is not a regular file", source);
  if (!range.whole && static_cast<uint64_t>(st.st_size) != range.source_size) {
    return CopyResult{CopyOutcome::Failed, 0,
                      "source " + source + " has " + std::to_string(st.st_size) +
                          " bytes, not the " + std::to_string(range.source_size) +
                          " its pieces were planned in; marked FAILED, readers use the PFS copy",
                      {}};
  }
  ::posix_fadvise(src.get(), static_cast<off_t>(range.whole ? 0 : range.offset),
                  static_cast<off_t>(range.whole ? 0 : range.length), POSIX_FADV_SEQUENTIAL);
  return std::nullopt;
}

CopyResult CopyEngine::copy(const std::string& source, const std::string& dest,
                            std::vector<char>& buffer, unsigned tag, const SourceRange& range) {
  const std::string dest_path = tree_.root() + "/" + dest;
  int dirfd = -1;
  if (auto failed = dest_dir(dest, dirfd)) return *failed;
  UniqueFd src;
  struct stat st {};
  if (auto failed = open_source(source, range, src, st)) return *failed;

  // One temporary name per copy thread, in the session directory: the tree of staged files
  // never holds a partial file, and a dead stager's temporaries go with its session.
  const std::string tmp = kTempPrefix + std::to_string(tag);
  UniqueFd out;
  if (auto failed = open_temp(tmp, dest_path, out)) return *failed;

  // Every return below removes the temporary name (a published copy keeps its other link).
  const TempGuard guard{tmp_dir_.get(), tmp};

  // The bytes: the whole source as it is now, or the piece's range of it.
  const uint64_t offset = range.whole ? 0 : range.offset;
  const uint64_t size = range.whole ? static_cast<uint64_t>(st.st_size) : range.length;
  uint64_t copied = 0;
  Fnv1a64 source_hash;
  bool kernel = !(pfs_.active() || verify_);  // the emulation and the checksum need the bytes
  std::optional<CopyResult> stop;
  if (kernel) stop = kernel_copy(src.get(), out.get(), offset, size, dest_path, copied, kernel);
  if (!stop && !kernel) {
    stop = stream_copy(src.get(), out.get(), offset, size, source, dest_path, buffer, copied,
                       source_hash);
  }
  if (!stop) stop = check_copy(tmp, source, dest_path, size, copied, buffer, source_hash);
  if (stop) return *stop;
  const struct timespec times[2] = {st.st_atim, st.st_mtim};
  if (::futimens(out.get(), times) != 0) return error_result(errno, "cannot set mtime of", dest_path);
  struct stat after {}, made {};
  if (::fstat(src.get(), &after) != 0) return error_result(errno, "cannot stat source", source);
  if (!(identity_of(after) == identity_of(st))) {
    return {CopyOutcome::Transient, 0, "source " + source + " changed while copying; retrying",
            {}};
  }
  if (::fstat(out.get(), &made) != 0) return error_result(errno, "cannot stat", dest_path);
  CopyResult r = publish(tmp, dirfd, dest, source, identity_of(st),
                         CopyId{static_cast<uint64_t>(made.st_ino),
                                static_cast<uint64_t>(made.st_dev)});
  if (r.outcome == CopyOutcome::Ok) {
    r.bytes = size;
    r.source_id = identity_of(st);
    r.has_checksum = verify_;
    r.checksum = verify_ ? source_hash.digest() : 0;
  }
  return r;
}

std::optional<CopyResult> CopyEngine::kernel_copy(int src, int out, uint64_t offset,
                                                  uint64_t size, const std::string& dest_path,
                                                  uint64_t& copied, bool& kernel) {
  bool use_sendfile = false;
  while (copied < size) {
    if (cancel_.load(std::memory_order_relaxed)) {
      return CopyResult{CopyOutcome::Cancelled, copied, "", {}};
    }
    size_t want = static_cast<size_t>(std::min<uint64_t>(size - copied, kKernelChunk));
    off_t from = static_cast<off_t>(offset + copied);
    ssize_t n = use_sendfile ? ::sendfile(out, src, &from, want)
                             : ::copy_file_range(src, &from, out, nullptr, want, 0);
    if (n < 0) {
      int err = errno;
      if (err == EINTR) continue;
      if (copied == 0 && !use_sendfile &&
          (err == EXDEV || err == EINVAL || err == ENOSYS || err == EOPNOTSUPP)) {
        use_sendfile = true;
        continue;
      }
      if (copied == 0 && use_sendfile && (err == EINVAL || err == ENOSYS)) {
        kernel = false;
        return std::nullopt;
      }
      return error_result(err, "cannot copy into", dest_path);
    }
    if (n == 0) break;  // source shrank; check_copy's size check
    copied += static_cast<uint64_t>(n);
  }
  return std::nullopt;
}

std::optional<CopyResult> CopyEngine::stream_copy(int src, int out, uint64_t offset,
                                                  uint64_t size, const std::string& source,
                                                  const std::string& dest_path,
                                                  std::vector<char>& buffer, uint64_t& copied,
                                                  Fnv1a64& source_hash) {
  while (copied < size) {
    if (cancel_.load(std::memory_order_relaxed)) {
      return CopyResult{CopyOutcome::Cancelled, copied, "", {}};
    }
    const size_t want = static_cast<size_t>(std::min<uint64_t>(size - copied, buffer.size()));
    ssize_t n = ::pread(src, buffer.data(), want, static_cast<off_t>(offset + copied));
    if (n < 0) {
      if (errno == EINTR) continue;
      return error_result(errno, "cannot read source", source);
    }
    if (n == 0) return std::nullopt;
    pfs_.on_read(static_cast<uint64_t>(n));
    if (verify_) source_hash.update(buffer.data(), static_cast<size_t>(n));
    if (int err = write_all(out, buffer.data(), static_cast<size_t>(n))) {
      return error_result(err, "cannot write", dest_path);
    }
    copied += static_cast<uint64_t>(n);
  }
  return std::nullopt;
}

std::optional<CopyResult> CopyEngine::check_copy(const std::string& tmp, const std::string& source,
                                                 const std::string& dest_path, uint64_t size,
                                                 uint64_t copied, std::vector<char>& buffer,
                                                 const Fnv1a64& source_hash) {
  if (copied != size) {
    return CopyResult{CopyOutcome::Transient, 0,
                      "source " + source + " changed size while copying (" +
                          std::to_string(copied) + " of " + std::to_string(size) +
                          " bytes); retrying",
                      {}};
  }
  if (!verify_) return std::nullopt;
  int err = 0;
  UniqueFd check(::openat(tmp_dir_.get(), tmp.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
  if (!check.valid()) return error_result(errno, "cannot reopen for verification", dest_path);
  const uint64_t dest_hash = hash_fd(check.get(), buffer, &err);
  if (err != 0) return error_result(err, "cannot read back for verification", dest_path);
  if (dest_hash != source_hash.digest()) {
    return CopyResult{CopyOutcome::Transient, 0,
                      "checksum mismatch for " + dest_path + " (copy of " + source +
                          "); retrying",
                      {}};
  }
  return std::nullopt;
}

CopyResult CopyEngine::receive(const std::string& source, const std::string& dest,
                               const SourceRange& range,
                               const std::function<Received(int fd)>& fill, unsigned tag) {
  const std::string dest_path = tree_.root() + "/" + dest;
  int dirfd = -1;
  if (auto failed = dest_dir(dest, dirfd)) return *failed;
  const std::string tmp = kTempPrefix + std::to_string(tag);
  const int tmp_dir = tmp_dir_.get();
  UniqueFd out;
  if (auto failed = open_temp(tmp, dest_path, out)) return *failed;
  const TempGuard guard{tmp_dir, tmp};

  const Received got = fill(out.get());
  if (!got.ok && got.err != 0) return error_result(got.err, "cannot write", dest_path);
  if (!got.ok) return {CopyOutcome::Failed, 0, got.message, {}};
  struct stat made {};
  if (::fstat(out.get(), &made) != 0) return error_result(errno, "cannot stat", dest_path);
  if (static_cast<uint64_t>(made.st_size) != range.length ||
      got.source_id.size != range.source_size) {
    return {CopyOutcome::Failed, 0, "a received copy of " + dest_path + " has the wrong size", {}};
  }
  if (verify_ && !got.has_checksum) {
    return {CopyOutcome::Failed, 0, "a received copy of " + dest_path + " has no checksum", {}};
  }
  const struct timespec times[2] = {
      {static_cast<time_t>(got.source_id.mtime_ns / 1000000000ull),
       static_cast<long>(got.source_id.mtime_ns % 1000000000ull)},
      {static_cast<time_t>(got.source_id.mtime_ns / 1000000000ull),
       static_cast<long>(got.source_id.mtime_ns % 1000000000ull)}};
  if (::futimens(out.get(), times) != 0) return error_result(errno, "cannot set mtime of", dest_path);
  CopyResult r = publish(tmp, dirfd, dest, source, got.source_id,
                         CopyId{static_cast<uint64_t>(made.st_ino),
                                static_cast<uint64_t>(made.st_dev)});
  if (r.outcome == CopyOutcome::Ok) {
    r.bytes = range.length;
    r.source_id = got.source_id;
    r.has_checksum = got.has_checksum;
    r.checksum = got.checksum;
  }
  return r;
}

CopyResult CopyEngine::publish(const std::string& tmp, int dirfd, const std::string& dest,
                               const std::string& source, const FileIdentity& source_id,
                               CopyId id) {
  const auto [dir, base] = split_dest(dest);
  const std::string dest_path = tree_.root() + "/" + dest;
  // Recorded before it is visible, so clean-up knows every file that may exist.
  ManifestRecord record;
  record.dest = dest;
  record.source = source;
  record.source_id = source_id;
  record.copy_ino = id.ino;
  record.copy_dev = id.dev;
  if (int err = manifest_.append(record)) return error_result(err, "cannot record", dest_path);
  for (int attempt = 0; attempt < 2; ++attempt) {
    if (::linkat(tmp_dir_.get(), tmp.c_str(), dirfd, base.c_str(), 0) == 0) {
      return {CopyOutcome::Ok, 0, "", id};
    }
    if (errno != EEXIST) return error_result(errno, "cannot publish (link)", dest_path);
    struct stat there {};
    if (::fstatat(dirfd, base.c_str(), &there, AT_SYMLINK_NOFOLLOW) != 0) continue;  // gone
    const auto known = manifest_.find(dest, static_cast<uint64_t>(there.st_ino),
                                      static_cast<uint64_t>(there.st_dev));
    if (!known || !S_ISREG(there.st_mode)) {
      CopyResult r;
      r.outcome = CopyOutcome::Failed;
      r.message = dest_path + " exists and was not created by hpcdl; it is left alone and "
                  "readers use the PFS copy";
      return r;
    }
    if (known->source_hash == Manifest::path_hash(source) && known->source_id == source_id) {
      // Another stager sharing the stage dir published the same bytes first.
      return {CopyOutcome::Ok, 0, "",
              CopyId{static_cast<uint64_t>(there.st_ino), static_cast<uint64_t>(there.st_dev)}};
    }
    ::unlinkat(dirfd, base.c_str(), 0);  // our own stale copy
  }
  return error_result(EEXIST, "cannot publish (link)", dest_path);
}

int CopyEngine::existing_dir(const std::string& dir) {
  try {
    return tree_.dir_for(dir, false);
  } catch (const StageError&) {
    return -1;
  }
}

std::optional<CopyId> CopyEngine::reusable(const std::string& source, const std::string& dest,
                                           uint64_t size, std::vector<char>& buffer) {
  const auto [dir, base] = split_dest(dest);
  const int dirfd = existing_dir(dir);
  if (dirfd < 0) return std::nullopt;
  struct stat local {};
  if (::fstatat(dirfd, base.c_str(), &local, AT_SYMLINK_NOFOLLOW) != 0) return std::nullopt;
  if (!S_ISREG(local.st_mode) || static_cast<uint64_t>(local.st_size) != size) {
    return std::nullopt;
  }
  const CopyId id{static_cast<uint64_t>(local.st_ino), static_cast<uint64_t>(local.st_dev)};
  const auto known = manifest_.find(dest, id.ino, id.dev);
  struct stat remote {};
  if (!known || known->source_hash != Manifest::path_hash(source) ||
      ::stat(source.c_str(), &remote) != 0) {
    return std::nullopt;
  }
  if (identity_of(remote) == known->source_id) return id;
  if (!verify_) return std::nullopt;
  UniqueFd a(::openat(dirfd, base.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
  UniqueFd b(::open(source.c_str(), O_RDONLY | O_CLOEXEC));
  if (!a.valid() || !b.valid()) return std::nullopt;
  int err_a = 0, err_b = 0;
  const uint64_t ha = hash_fd(a.get(), buffer, &err_a);
  const uint64_t hb = hash_fd(b.get(), buffer, &err_b);
  if (err_a == 0 && err_b == 0 && ha == hb) return id;
  return std::nullopt;
}

int CopyEngine::remove(const std::string& dest, CopyId id) {
  const auto [dir, base] = split_dest(dest);
  int dirfd = -1;
  try {
    dirfd = tree_.dir_for(dir, false);
  } catch (const StageError& e) {
    return e.err() ? e.err() : ENOTDIR;
  }
  if (dirfd < 0) return ENOENT;
  struct stat there {};
  if (::fstatat(dirfd, base.c_str(), &there, AT_SYMLINK_NOFOLLOW) != 0) return errno;
  if (static_cast<uint64_t>(there.st_ino) != id.ino ||
      static_cast<uint64_t>(there.st_dev) != id.dev) {
    return ENOENT;  // replaced since: not the file this stager made
  }
  return ::unlinkat(dirfd, base.c_str(), 0) == 0 ? 0 : errno;
}

int CopyEngine::discard(const std::string& dest) {
  const auto [dir, base] = split_dest(dest);
  const int dirfd = existing_dir(dir);
  struct stat there {};
  if (dirfd < 0 || ::fstatat(dirfd, base.c_str(), &there, AT_SYMLINK_NOFOLLOW) != 0 ||
      !S_ISREG(there.st_mode) ||
      !manifest_.find(dest, static_cast<uint64_t>(there.st_ino),
                      static_cast<uint64_t>(there.st_dev))) {
    return 0;
  }
  return ::unlinkat(dirfd, base.c_str(), 0) == 0 ? 0 : errno;
}

}  // namespace hpcdl
