// Unit tests of hpcdl-stage's pure parts: destination validation, plan parsing, next-use
// eviction order, symlink refusal in the stage tree, kept peer connections, peer deferrals,
// residency, the copy threads. Run by ctest (HPCDL_STAGE_TESTS=ON) and by
// tests/test_staging_sanitizers.py under ASan/UBSan and under TSan.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common.h"
#include "copy_engine.h"
#include "copy_threads.h"
#include "eviction.h"
#include "manifest.h"
#include "peer.h"
#include "peer_deferrals.h"
#include "plan.h"
#include "residency.h"

namespace {

int failures = 0;

void check(bool ok, const std::string& what) {
  if (!ok) {
    std::cerr << "FAIL: " << what << "\n";
    ++failures;
  }
}

// A TCP socket bound to a free loopback port (and listening, with listening): its fd and port
// in *port, or -1.
int loopback_socket(bool listening, uint16_t* port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_in addr {};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  if (fd < 0 || ::bind(fd, reinterpret_cast<struct sockaddr*>(&addr), sizeof addr) != 0 ||
      (listening && ::listen(fd, 16) != 0) ||
      ::getsockname(fd, reinterpret_cast<struct sockaddr*>(&addr), &len) != 0) {
    if (fd >= 0) ::close(fd);
    return -1;
  }
  *port = ntohs(addr.sin_port);
  return fd;
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string scratch = argc > 1 ? argv[1] : "unit-scratch";
  ::mkdir(scratch.c_str(), 0700);
  std::string why;

  check(hpcdl::is_safe_relative("a/b.h5", &why), "plain relative path accepted");
  check(!hpcdl::is_safe_relative("/etc/passwd", &why), "absolute path rejected");
  check(!hpcdl::is_safe_relative("a/../../x", &why), "'..' rejected");
  check(!hpcdl::is_safe_relative("a//b", &why), "empty component rejected");
  check(!hpcdl::is_safe_relative(".hpcdl/status", &why), ".hpcdl rejected");

  const std::string good = scratch + "/plan";
  write_file(good,
             "hpcdl-plan 1\nfingerprint 00ff\nseed 1\nepochs 0 2\nsteps_per_epoch 3\n"
             "local_ranks 2\ndataset_files 4\nentries 3\n"
             "2\t10\t0,4\tb\t/src/b\n0\t5\t1\ta/x\t/src/a/x\n3\t7\t2,3\tc\t/src/c\nend\n");
  const hpcdl::Plan plan = hpcdl::read_plan(good);
  check(plan.entries.size() == 3 && plan.dest(plan.entries[1]) == "a/x", "plan parsed");
  check(plan.source(plan.entries[0]) == "/src/b" && plan.source(plan.entries[1]) == "/src/a/x",
        "sources rebuilt from the shared prefix and the destination's tail");
  check(plan.prefixes.size() == 1 && plan.ticks(plan.entries[2]).size() == 2, "compact plan");
  hpcdl::Plan mixed;
  mixed.add(0, 1, "k/a/x", "/r/a/x", {});
  mixed.add(1, 1, "k/b", "/other/c", {1, 2});
  mixed.add(2, 1, "x", "x", {});
  check(mixed.source(mixed.entries[0]) == "/r/a/x" && mixed.source(mixed.entries[1]) == "/other/c" &&
            mixed.source(mixed.entries[2]) == "x" && mixed.dest(mixed.entries[1]) == "k/b",
        "any source is rebuilt exactly");
  check(hpcdl::fingerprint_number(plan.fingerprint) == 0xff, "fingerprint number");

  hpcdl::NextUseSchedule schedule(plan);
  check(schedule.next_use(0, 1) == 4 && schedule.next_use(1, 2) == hpcdl::NextUseSchedule::kNever,
        "next use");
  for (size_t i = 0; i < 3; ++i) schedule.set_resident(i, true);
  // At cursor 2: entry 0 next at 4, entry 1 never, entry 2 at 2 -> victim order 1, 0; never 2.
  auto v = schedule.pick_victim(2, 2, 3);
  check(v && *v == 1, "farthest next use evicted first");
  v = schedule.pick_victim(2, 2, 3);
  check(v && *v == 0, "then the next farthest");
  v = schedule.pick_victim(2, 2, 3);
  check(!v, "a file about to be read is never evicted");

  for (const char* bad : {"hpcdl-plan 1\nentries 1\nlocal_ranks 1\ndataset_files 1\n"
                          "0\t1\t0\t/abs\t/src\nend\n",
                          "hpcdl-plan 1\nlocal_ranks 1\ndataset_files 1\nentries 1\n"
                          "0\t1\t0\t../up\t/src\nend\n",
                          "hpcdl-plan 1\nlocal_ranks 1\ndataset_files 1\nentries 2\n"
                          "0\t1\t0\tok\t/src\n",
                          "hpcdl-plan 9\n"}) {
    write_file(good, bad);
    bool threw = false;
    try {
      hpcdl::read_plan(good);
    } catch (const hpcdl::StageError& e) {
      threw = std::string(e.what()).find(good) != std::string::npos;
    }
    check(threw, std::string("bad plan rejected with its path: ") + bad);
  }

  // The peer section: addresses and per-entry sources, each checked against the plan.
  const std::string head =
      "hpcdl-plan 1\nfingerprint 00ff\nseed 1\nepochs 0 2\nsteps_per_epoch 3\n"
      "local_ranks 1\ndataset_files 4\nentries 2\n2\t10\t0,4\tb\t/src/b\n0\t5\t1\ta\t/src/a\n";
  write_file(good, head + "peers 1\n3\t10.0.0.3:4000\npeer_sources 1\n0\t3\t1\nend\n");
  const hpcdl::Plan peered = hpcdl::read_plan(good);
  check(peered.peers.size() == 1 && peered.peers[0].host == "10.0.0.3" &&
            peered.peers[0].port == 4000 && peered.peers[0].node == 3,
        "peer address parsed");
  check(peered.peer_source(0).peer == -1 && peered.peer_source(1).peer == 0 &&
            peered.peer_source(1).ready_tick == 1,
        "peer sources belong to their entries");
  for (const std::string bad_peers :
       {"peers 1\n3\thost:4000\npeer_sources 0\nend\n",     // not an IPv4 address
        "peers 1\n3\t10.0.0.3:0\npeer_sources 0\nend\n",     // no port
        "peers 1\n3\t10.0.0.3:4000\npeer_sources 1\n1\t3\t0\nend\n",  // not an entry
        "peers 1\n3\t10.0.0.3:4000\npeer_sources 1\n0\t4\t0\nend\n",  // not a peer
        "peers 1\n3\t10.0.0.3:4000\npeer_sources 2\n0\t3\t0\nend\n",  // short
        "peers 1\n3\t10.0.0.3:4000\npeer_sources 0\n"}) {                // no end
    write_file(good, head + bad_peers);
    bool threw = false;
    try {
      hpcdl::read_plan(good);
    } catch (const hpcdl::StageError& e) {
      threw = std::string(e.what()).find(good) != std::string::npos;
    }
    check(threw, "bad peer section rejected: " + bad_peers);
  }

  // The pieces section: piece entries (slots 4 and 5) of shard 2, after the peer section or
  // without one; each impossible line is refused naming its line.
  const std::string pieced_head =
      "hpcdl-plan 1\nfingerprint 00ff\nseed 1\nepochs 0 2\nsteps_per_epoch 3\n"
      "local_ranks 1\ndataset_files 9\nentries 3\n2\t10\t0,4\tb\t/src/b\n"
      "4\t3\t1\tb.pieces/0\t/src/b\n5\t4\t2\tb.pieces/6\t/src/b\n";
  write_file(good, pieced_head + "peers 1\n3\t10.0.0.3:4000\npeer_sources 1\n5\t3\t1\n"
                   "pieces 2\n5\t2\t10\t6\n4\t2\t10\t0\nend\n");
  const hpcdl::Plan pieced = hpcdl::read_plan(good);
  check(!pieced.is_piece(0) && pieced.is_piece(1) && pieced.piece(2).offset == 6 &&
            pieced.piece(2).shard_id == 2 && pieced.piece(2).shard_size == 10 &&
            pieced.peer_source(2).peer == 0,
        "pieces parsed beside the peer section");
  write_file(good, pieced_head + "pieces 1\n4\t7\t3\t0\nend\n");
  check(hpcdl::read_plan(good).piece(1).shard_id == 7, "pieces without a peer section");
  for (const auto& [bad_pieces, line] : std::vector<std::pair<std::string, int>>{
           {"pieces 1\n4\t2\t10\n", 13},             // three fields
           {"pieces 1\n3\t2\t10\t0\n", 13},         // not an entry
           {"pieces 1\n4\t9\t10\t0\n", 13},         // shard id past dataset_files
           {"pieces 1\n5\t2\t10\t7\n", 13},         // ends past the shard
           {"pieces 1\n5\t2\t10\t99999999999999999999999\n", 13},  // no number
           {"pieces 2\n4\t2\t10\t0\n4\t2\t10\t3\n", 14},  // twice
           {"pieces 2\n4\t2\t10\t0\n5\t2\t11\t0\n", 14},  // two sizes of one shard
           {"pieces 1\n4\t2\t9\t0\n", 13},          // not the shard entry's size
           {"pieces 2\n4\t5\t10\t0\n5\t2\t10\t0\n", 13},  // shard 5 is a piece
           {"pieces 4\n", 12},                          // more than the entries
           {"pieces 2\n4\t2\t10\t0\n", 14},          // truncated
           {"pieces 1\n4\t2\t10\t0\npeers 0\n", 14}}) {  // peers after pieces
    write_file(good, pieced_head + bad_pieces + "end\n");
    std::string said;
    try {
      hpcdl::read_plan(good);
    } catch (const hpcdl::StageError& e) {
      said = e.what();
    }
    const std::string where = good + " line " + std::to_string(line) + ":";
    check(said.find(where) != std::string::npos && said.find('\n') == std::string::npos,
          "bad pieces section refused at line " + std::to_string(line) + ": " + bad_pieces +
              " (said: " + said + ")");
  }

  // The job's secret: 64 hex digits on a pipe, nothing else.
  for (const std::string& text : {std::string(64, 'a') + "\n", std::string(63, 'a') + "\n",
                                 std::string(64, 'G') + "\n"}) {
    int fds[2];
    check(::pipe(fds) == 0, "pipe");
    check(::write(fds[1], text.data(), text.size()) == static_cast<ssize_t>(text.size()), "write");
    ::close(fds[1]);
    bool ok = true;
    std::string secret;
    try {
      secret = hpcdl::read_peer_secret(fds[0]);
    } catch (const hpcdl::StageError&) {
      ok = false;
    }
    ::close(fds[0]);
    const bool want = text.size() == 65 && text[0] == 'a';
    check(ok == want && (!ok || secret == std::string(32, '\xaa')), "secret read: " + text);
  }

  const std::string tree_root = scratch + "/tree";
  ::mkdir(tree_root.c_str(), 0700);
  ::unlink((tree_root + "/link").c_str());
  check(::symlink("/tmp", (tree_root + "/link").c_str()) == 0, "symlink made");
  ::unlink((scratch + "/manifest").c_str());
  hpcdl::Manifest manifest(scratch + "/manifest");
  hpcdl::StageTree tree(tree_root, manifest);
  bool refused = false;
  try {
    tree.dir_for("link/sub", true);
  } catch (const hpcdl::StageError&) {
    refused = true;
  }
  check(refused, "symlinked directory inside the stage dir refused");
  check(tree.dir_for("real/sub", true) >= 0, "real directories created");
  struct stat sub {};
  ::stat((tree_root + "/real/sub").c_str(), &sub);
  check(manifest.find("real/sub", sub.st_ino, sub.st_dev).has_value(), "created dirs recorded");
  check(!manifest.find("link", sub.st_ino, sub.st_dev), "foreign entries are not recorded");

  // Manifest records carry any name but NUL; a torn tail is ignored, never misparsed.
  hpcdl::ManifestRecord rec;
  rec.dest = "a\nb\tc/d e";
  rec.source = "/pfs/x\ny";
  rec.source_id = hpcdl::FileIdentity{1, 2, 3, 4, 5};
  rec.copy_ino = 6;
  rec.copy_dev = 7;
  const std::string bytes = hpcdl::encode_record(rec) + hpcdl::encode_record(rec);
  std::vector<hpcdl::ManifestRecord> decoded;
  const size_t used = hpcdl::decode_records(bytes.substr(0, bytes.size() - 3), &decoded);
  check(decoded.size() == 1 && decoded[0].dest == rec.dest && decoded[0].source == rec.source &&
            decoded[0].source_id == rec.source_id && decoded[0].copy_dev == 7,
        "manifest record round trip");
  check(used == bytes.size() / 2, "torn manifest tail left unparsed");

  // The index keeps the newest record of each (dest, copy inode), and finds it by hash.
  ::unlink((scratch + "/manifest2").c_str());
  hpcdl::Manifest index(scratch + "/manifest2");
  rec.dest = "k/a";
  check(index.append(rec) == 0, "record appended");
  rec.source = "/pfs/newer";
  rec.source_id.mtime_ns = 9;
  check(index.append(rec) == 0, "newer record of the same copy appended");
  rec.copy_ino = 8;
  rec.source = "/pfs/other";
  check(index.append(rec) == 0, "record of another copy appended");
  const auto six = index.find("k/a", 6, 7);
  const auto eight = index.find("k/a", 8, 7);
  check(six && six->source_hash == hpcdl::Manifest::path_hash("/pfs/newer") &&
            six->source_id.mtime_ns == 9,
        "newest record of a copy wins");
  check(eight && eight->source_hash == hpcdl::Manifest::path_hash("/pfs/other"),
        "each copy of a name has its own record");
  check(!index.find("k/b", 6, 7) && !index.find("k/a", 6, 8), "unknown name or copy not found");

  // Kept peer connections: two fetches share one connection; one the peer closed while it sat
  // in the pool is replaced (not taken for a dead peer), and the bytes arrive whole.
  {
    const std::string rel = "real/sub/served";
    write_file(tree_root + "/" + rel, "peer bytes");
    struct stat st {};
    ::stat((tree_root + "/" + rel).c_str(), &st);
    hpcdl::ServedCopy copy;
    copy.dest = rel;
    copy.size = static_cast<uint64_t>(st.st_size);
    copy.source_id = hpcdl::identity_of(st);
    copy.id = hpcdl::CopyId{static_cast<uint64_t>(st.st_ino), static_cast<uint64_t>(st.st_dev)};
    uint16_t port = 0;
    const int listener = loopback_socket(true, &port);
    check(listener >= 0, "loopback listener");
    const std::string secret(hpcdl::kPeerSecretBytes, 's');
    const hpcdl::PeerAddress peer{0, "127.0.0.1", port};
    hpcdl::PeerClient client(secret);
    std::vector<char> buffer(1 << 16);
    const std::atomic<bool> cancel{false};
    // The bytes a fetch of `range` got ("" when it was not Ok: its outcome in *how).
    auto fetched = [&](hpcdl::PeerServer& server, const hpcdl::SourceRange& range,
                       hpcdl::PeerOutcome* how) {
      server.offer(7, copy);
      const std::string out = scratch + "/fetched";
      hpcdl::UniqueFd fd(::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
      const hpcdl::PeerFetch got = client.fetch(peer, 7, range, false, fd.get(), buffer, cancel);
      std::ifstream in(out, std::ios::binary);
      const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      *how = got.outcome;
      return got.outcome == hpcdl::PeerOutcome::Ok ? bytes : std::string();
    };
    auto fetched_whole = [&](hpcdl::PeerServer& server) {
      hpcdl::PeerOutcome how{};
      return fetched(server, hpcdl::SourceRange::file(copy.size), &how) == "peer bytes";
    };
    auto quiet = [](const std::string&) {};
    {
      hpcdl::PeerServer first(::dup(listener), secret, tree, 2, quiet);
      check(fetched_whole(first) && fetched_whole(first), "two fetches from a peer");
      check(client.connections_opened() == 1, "two fetches share one connection");
    }  // this server's end of the pooled connection closes
    hpcdl::PeerServer second(::dup(listener), secret, tree, 2, quiet);
    check(fetched_whole(second), "a pooled connection the peer closed is replaced");
    check(client.connections_opened() == 2, "one new connection for it");
    // A range of a served file: its bytes only, counted as served; one past the end: not here
    // (the connection stays), nothing counted.
    hpcdl::PeerOutcome how{};
    // The server counts after its last send: wait for it (at most 5 s).
    auto served_bytes = [&](uint64_t want) {
      for (int k = 0; k < 500 && second.bytes_served() < want; ++k) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      return second.bytes_served();
    };
    const uint64_t before = served_bytes(copy.size);  // its one whole fetch
    const std::string range_bytes = fetched(second, hpcdl::SourceRange{5, 5, copy.size, false}, &how);
    check(range_bytes == "bytes" && served_bytes(before + 5) == before + 5,
          "a range fetched, its bytes counted: '" + range_bytes + "', " +
              std::to_string(second.bytes_served() - before));
    check(fetched(second, hpcdl::SourceRange{0, 0, copy.size, false}, &how).empty() &&
              how == hpcdl::PeerOutcome::Ok,
          "an empty range fetched");
    for (const auto& past : {hpcdl::SourceRange{6, 5, copy.size, false},
                             hpcdl::SourceRange{~0ull, 2, copy.size, false}}) {
      check(fetched(second, past, &how).empty() && how == hpcdl::PeerOutcome::NotHere &&
                served_bytes(before + 5) == before + 5,
            "a range past the end is not served (" + std::to_string(static_cast<int>(how)) + ")");
    }
    check(fetched(second, hpcdl::SourceRange{1, 3, copy.size, false}, &how) == "eer" &&
              client.connections_opened() == 2,
          "the connection serves on after a refused range");
    ::close(listener);
  }

  {  // Peer deferrals: set aside until released, in next-use order, once per entry.
    hpcdl::PeerDeferrals deferrals;
    deferrals.reset(4);
    const auto next_use = [](size_t entry) { return static_cast<uint32_t>(10 + entry); };
    const auto needed = [](size_t) { return true; };
    deferrals.defer(2, 8, 5);
    deferrals.defer(1, 6, 3);
    deferrals.defer(2, 9, 1);  // set aside already: no second record
    check(!deferrals.front(next_use, needed, 0), "nothing ready before its release");
    deferrals.release(next_use, [](const hpcdl::PeerDeferrals::Deferred& d) {
      return d.ready_tick < 4; }, 4);
    auto first = deferrals.front(next_use, needed, 4);
    check(first && first->entry == 1 && first->tick == 6, "the released one is ready");
    deferrals.pop();
    check(!deferrals.front(next_use, needed, 4), "the other waits for its home");
    deferrals.release(next_use, [](const hpcdl::PeerDeferrals::Deferred&) { return true; }, 9);
    first = deferrals.front(next_use, needed, 9);
    check(first && first->entry == 2 && first->tick == 12, "a passed use moves to the next");
    deferrals.pop();
    check(!deferrals.front(next_use, needed, 9), "each entry once");
    deferrals.defer(2, 20, 19);  // popped: may be set aside again
    deferrals.release(next_use, [](const hpcdl::PeerDeferrals::Deferred&) { return true; }, 0);
    check(!deferrals.front(next_use, [](size_t) { return false; }, 0), "unneeded: dropped");
  }

  {  // Residency: ENOSPC shrinks the capacity to what is resident; a copy in flight then still
     // lands and the capacity grows back to cover it; a new plan may grow again.
    hpcdl::Residency space(100);
    space.adopt(40);
    check(space.fits(60) && !space.fits(61), "fits what the capacity leaves");
    space.started(30);
    space.started(20);
    check(!space.fits(11), "copies in flight count");
    space.finished(20);
    check(space.ran_out_of_space() && !space.ran_out_of_space(), "out of space said once");
    check(space.capacity() == 40 && space.out_of_space(), "capacity shrinks to what is resident");
    check(space.landed(30) && space.capacity() == 70, "a late copy grows it back to cover it");
    space.finished(30);
    space.evicted(70);
    check(space.resident() == 0 && space.fits(70) && !space.fits(71), "evicted bytes are free");
    space.adopt(10);
    check(!space.out_of_space(), "a new plan may try again");
  }

  {  // Copy threads: a job copied from the PFS; one planned from a peer nobody listens for
     // falls back to the PFS, and that peer is not asked again.
    const std::string session = scratch + "/session";
    ::mkdir(session.c_str(), 0700);
    write_file(scratch + "/pfs-a", "pfs bytes");
    hpcdl::PfsEmulation pfs;
    const std::atomic<bool> cancel{false};
    hpcdl::CopyEngine engine(tree, manifest, session, pfs, false, cancel);
    hpcdl::PeerClient client(std::string(hpcdl::kPeerSecretBytes, 's'));
    uint16_t port = 0;
    const int probe = loopback_socket(false, &port);
    check(probe >= 0, "a free loopback port");
    ::close(probe);  // nobody listens there now
    std::atomic<int> logged{0};
    hpcdl::CopyThreads copiers(engine, &client, false, tree_root, cancel,
                               [&](const std::string&) { logged.fetch_add(1); });
    copiers.start(2);
    hpcdl::CopyThreads::Job plain{0, scratch + "/pfs-a", "threads/a", 1, 9, std::nullopt};
    hpcdl::CopyThreads::Job peered{1, scratch + "/pfs-a", "threads/b", 2, 9,
                                   hpcdl::PeerAddress{5, "127.0.0.1", port}};
    copiers.queue({plain, peered});
    std::vector<hpcdl::CopyThreads::Done> done(2);
    int got = 0;
    for (int k = 0; k < 1000 && got < 2; ++k) {
      copiers.wait_done(std::chrono::milliseconds(10));
      for (auto& d : copiers.take_done()) done[d.entry] = d, ++got;
    }
    copiers.stop();
    std::ifstream in(tree_root + "/threads/b", std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    check(got == 2 && done[0].result.outcome == hpcdl::CopyOutcome::Ok && !done[0].peer_fallback &&
              done[1].result.outcome == hpcdl::CopyOutcome::Ok && done[1].peer_fallback &&
              !done[1].from_peer && bytes == "pfs bytes",
          "copied from the PFS, the missing peer's file too");
    check(copiers.peer_down(5) && !copiers.peer_down(6) && logged.load() == 1,
          "the missing peer is down, said once");
    check(copiers.pfs_opens() == 2, "two PFS copies");
  }

  {  // A piece from the PFS: the range's bytes only (with verify, its checksum), the shard's
     // identity recorded; a shard of another size than planned fails; discard removes what the
     // manifest lists, never a stranger's file.
    const std::string session = scratch + "/session-pieces";
    ::mkdir(session.c_str(), 0700);
    write_file(scratch + "/shard", "0123456789");
    struct stat shard {};
    ::stat((scratch + "/shard").c_str(), &shard);
    hpcdl::PfsEmulation pfs;
    const std::atomic<bool> cancel{false};
    std::vector<char> buffer(4);  // smaller than a piece: the range spans reads
    for (const bool verify : {false, true}) {
      hpcdl::CopyEngine engine(tree, manifest, session, pfs, verify, cancel);
      const std::string dest = std::string(verify ? "v" : "k") + "/shard.pieces/3";
      const auto r = engine.copy(scratch + "/shard", dest, buffer, 0,
                                 hpcdl::SourceRange{3, 6, 10, false});
      std::ifstream in(tree_root + "/" + dest, std::ios::binary);
      const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      hpcdl::Fnv1a64 range_hash;
      range_hash.update("345678", 6);
      check(r.outcome == hpcdl::CopyOutcome::Ok && bytes == "345678" && r.bytes == 6 &&
                r.source_id == hpcdl::identity_of(shard) &&
                (!verify || (r.has_checksum && r.checksum == range_hash.digest())),
            std::string("a piece copied from the PFS range") + (verify ? " (verified)" : "") +
                ": " + r.message);
      check(manifest.find(dest, r.id.ino, r.id.dev).has_value(), "a piece is recorded");
      const auto wrong = engine.copy(scratch + "/shard", dest + "x", buffer, 0,
                                     hpcdl::SourceRange{3, 6, 11, false});
      check(wrong.outcome == hpcdl::CopyOutcome::Failed, "a shard of another size: no piece");
      check(engine.discard(dest) == 0 && ::access((tree_root + "/" + dest).c_str(), F_OK) != 0,
            "discard removes a piece hpcdl made");
    }
    write_file(tree_root + "/k/shard.pieces/7", "not ours");
    hpcdl::CopyEngine engine(tree, manifest, session, pfs, false, cancel);
    check(engine.discard("k/shard.pieces/7") == 0 &&
              ::access((tree_root + "/k/shard.pieces/7").c_str(), F_OK) == 0,
          "discard leaves a file hpcdl did not make");
  }

  std::cout << (failures ? "FAILED" : "OK") << " (" << failures << " failures)\n";
  return failures ? 1 : 0;
}
