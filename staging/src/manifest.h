// The manifest (<stage_dir>/.hpcdl/manifest): every file and directory that a stager created in
// the stage dir, with the identity of the source each copy was made from. All stagers sharing
// the stage dir append to it; clean-up (hpcdl/staging/cleanup.py) deletes exactly what it lists,
// and a staged file is reused only when its record matches the source as it is now.
//
// Format (docs/staging.md), version 1: a sequence of records, each "R1 <length>\n" followed by
// <length> bytes of NUL-separated fields: kind ('f' or 'd'), dest (relative to the stage dir),
// source, then decimal source size, mtime_ns, ctime_ns, inode, device, copy inode, copy device.
// Names may hold any byte but NUL. A record is appended with one write() on an O_APPEND
// descriptor, so concurrent stagers never interleave; a torn tail is ignored.
#pragma once

#include <sys/stat.h>

#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "common.h"

namespace hpcdl {

// What identifies a file's bytes without reading them.
struct FileIdentity {
  uint64_t size = 0, mtime_ns = 0, ctime_ns = 0, ino = 0, dev = 0;
  bool operator==(const FileIdentity& o) const {
    return size == o.size && mtime_ns == o.mtime_ns && ctime_ns == o.ctime_ns && ino == o.ino &&
           dev == o.dev;
  }
};

FileIdentity identity_of(const struct stat& st);

struct ManifestRecord {
  char kind = 'f';          // 'f': a staged copy, 'd': a directory the stager created
  std::string dest;         // relative to the stage dir
  std::string source;       // the PFS path it was copied from ("" for 'd')
  FileIdentity source_id;   // the source when the copy began (zero for 'd')
  uint64_t copy_ino = 0;    // the created file or directory
  uint64_t copy_dev = 0;
};

std::string encode_record(const ManifestRecord& r);

// Parses records from `data`; stops at the first incomplete or malformed one and returns how
// many bytes were consumed.
size_t decode_records(const std::string& data, std::vector<ManifestRecord>* out);

class Manifest {
 public:
  // Opens (creating with mode 0600) the manifest; throws StageError when that fails.
  explicit Manifest(const std::string& path);

  // Appends one record; returns 0 or the errno.
  int append(const ManifestRecord& r);

  // What a reuse check needs of the record for `dest` whose created file is (ino, dev), also
  // among records that other stagers appended since the last look.
  struct Match {
    uint64_t source_hash = 0;  // path_hash(source)
    FileIdentity source_id;
  };
  std::optional<Match> find(const std::string& dest, uint64_t ino, uint64_t dev);

  // FNV-1a of a path: records are indexed by hashes, not by copies of their names.
  static uint64_t path_hash(const std::string& path);

 private:
  void refresh_locked();
  void index(const ManifestRecord& r);

  // One record: 64 bytes, keyed by path_hash(dest). A stage dir holding 1.28 M kept copies
  // indexed its records as strings in a map of vectors (several hundred bytes each). A copy is
  // found by its inode and device too, and reuse compares the source's full identity, so a
  // hash shared by two names cannot make a stranger's bytes count as a copy.
  struct Known {
    uint64_t copy_ino = 0, copy_dev = 0;
    Match match;
  };

  std::string path_;
  UniqueFd fd_;
  std::mutex mu_;
  uint64_t consumed_ = 0;
  std::unordered_multimap<uint64_t, Known> by_dest_;
};

}  // namespace hpcdl
