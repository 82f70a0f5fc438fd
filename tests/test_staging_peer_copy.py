"""The stager side of the peer tier: real hpcdl-stage processes serving each other over TCP.

A home stager stages a small tree from the "PFS" and serves it on a loopback socket that the
test hands over, as a node leader does; a second stager (another stage dir, another "node")
fetches the same files through the plan's peer section. Each fault the issue names ends with
every byte right and the PFS read instead (docs/staging.md, "Peer tier").
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import shlex
import signal
import socket
import struct
import subprocess
import threading
import time
from pathlib import Path

import pytest
from helpers import make_tree, write_peer_plan

from hpcdl.data.sampler import SamplerSpec
from hpcdl.staging.binary import find_stager_binary
from hpcdl.staging.manifest import read_manifest
from hpcdl.staging.plan import plan_for_node
from hpcdl.staging.status import ProgressFile, StatusView

FILES = 24
SESSION = "job"
PENDING, READY = 0, 2  # a file's states in the status map (docs/staging.md)
REFUSED = "refused a peer connection from 127.0.0.1: wrong or missing job secret"


def write_plan(ds, stage: Path, node: int, peer_address: str | None) -> None:
    """One node's plan of every file; with peer_address, every file is fetched from node 0."""
    write_peer_plan(ds, stage, SESSION, node, peer_address)


def start(stage: Path, secret: str, listener: socket.socket | None = None, *flags: str):
    cmd = [str(find_stager_binary()), "--stage-dir", str(stage), "--session", SESSION]
    cmd += ["--threads", "4", "--peer", *flags]
    fds: tuple[int, ...] = ()
    if listener is not None:
        cmd += ["--peer-listen-fd", str(listener.fileno())]
        fds = (listener.fileno(),)
    proc = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True, pass_fds=fds
    )
    proc.stdin.write(secret + "\n")
    proc.stdin.close()
    proc.stdin = None  # read once by the stager; communicate() must not flush it
    return proc


def status(stage: Path) -> StatusView:
    view = StatusView(stage / ".hpcdl" / "sessions" / SESSION / "status")
    deadline = time.monotonic() + 10
    while not view.open():
        assert time.monotonic() < deadline, "no status map"
        time.sleep(0.02)
    return view


@pytest.fixture
def home(tmp_path):
    """A home stager that has staged every file and serves them: (ds, address, secret, proc)."""
    ds = make_tree(tmp_path / "pfs", FILES, 3000)
    listener = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    secret = secrets.token_hex(32)
    write_plan(ds, tmp_path / "a", 0, None)
    proc = start(tmp_path / "a", secret, listener)
    listener.close()  # the stager holds its own descriptor
    view = status(tmp_path / "a")
    deadline = time.monotonic() + 30
    while view.field("plan_ready") < FILES:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.02)
    yield ds, address, secret, proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGUSR1)
    proc.wait(timeout=15)


def fetch(ds, tmp_path, address: str, secret: str, *flags: str) -> tuple[StatusView, str]:
    """A second node's stager, --once, every file planned from the home."""
    write_plan(ds, tmp_path / "b", 1, address)
    proc = start(tmp_path / "b", secret, None, "--once", *flags)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return status(tmp_path / "b"), err


def assert_copies_are_the_sources(ds, stage: Path) -> None:
    for f in ds.files:
        copy, source = stage / "k" / f.relpath, ds.root / f.relpath
        assert copy.read_bytes() == source.read_bytes(), f.relpath
        assert copy.stat().st_mtime_ns == source.stat().st_mtime_ns, f.relpath
    assert not [p for p in (stage / ".hpcdl" / "sessions" / SESSION).iterdir() if "tmp." in p.name]


def test_home_serves_and_peer_copies_obey_every_rule(home, tmp_path):
    ds, address, secret, proc = home
    view, _ = fetch(ds, tmp_path, address, secret)
    assert view.field("peer_files") == FILES and view.field("pfs_opens") == 0
    assert view.field("peer_bytes") == sum(f.size for f in ds.files)
    assert view.field("peer_fallbacks") == 0
    assert_copies_are_the_sources(ds, tmp_path / "b")
    # Manifest ownership: every copy is recorded with the PFS original's identity.
    records = {r.dest: r for r in read_manifest(tmp_path / "b" / ".hpcdl" / "manifest")}
    for f in ds.files:
        st = (ds.root / f.relpath).stat()
        record = records[f"k/{f.relpath}"]
        assert record.source == str(ds.root / f.relpath)
        identity = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)
        assert record.source_identity == identity
    served = status(tmp_path / "a")
    deadline = time.monotonic() + 5
    while served.field("files_served") < FILES and time.monotonic() < deadline:
        time.sleep(0.05)  # the home publishes its counters with its heartbeat
    assert served.field("files_served") == FILES
    assert served.field("pfs_opens") == FILES  # the home read each file once


def test_fetches_reuse_one_connection_per_copy_thread(home, tmp_path):
    """A connection carries one request after another: the fetcher's 4 copy threads open at most
    4 connections for FILES files (not one per file), and every byte is still right."""
    ds, address, secret, _ = home
    view, _ = fetch(ds, tmp_path, address, secret)
    assert view.field("peer_files") == FILES
    assert 1 <= view.field("peer_connections") <= 4
    assert_copies_are_the_sources(ds, tmp_path / "b")


def test_a_connection_carries_one_request_after_another(home):
    """The wire format (docs/staging.md, "Peer tier"): a 56-byte request, a 64-byte reply; a
    "not here" leaves the connection open for the next request, a refusal closes it."""
    _, address, secret, _ = home
    port = int(address.split(":")[1])

    def request(secret_hex: str, file_id: int) -> bytes:  # a size no file has: "not here"
        return b"HPCDLPQ1" + bytes.fromhex(secret_hex) + struct.pack("<IIQ", file_id, 0, 1)

    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        for file_id in range(3):
            conn.sendall(request(secret, file_id))
            reply = conn.recv(64, socket.MSG_WAITALL)
            assert reply[:8] == b"HPCDLPA1" and struct.unpack_from("<I", reply, 8) == (1,)
        conn.sendall(request(secrets.token_hex(32), 0))
        reply = conn.recv(64, socket.MSG_WAITALL)
        assert reply[:8] == b"HPCDLPA1" and struct.unpack_from("<I", reply, 8) == (2,)
        assert conn.recv(1) == b""  # refused, and closed


def fetcher_at(ds, stage: Path, address: str, batch: int, at: int, ready: dict[int, int]):
    """A fetching node's plan (every file from the home at address; `ready`: entry -> the
    home's read tick, else 0) and its progress file at step `at`: (plan, ProgressFile)."""
    plan = write_peer_plan(ds, stage, SESSION, 1, address, batch, ready)
    progress = ProgressFile.create(stage / ".hpcdl" / "sessions" / SESSION / "progress", 1)
    progress.set(0, at)
    return plan, progress


@contextlib.contextmanager
def running_fetcher(stage: Path, secret: str, progress: ProgressFile):
    """A fetching stager that follows the progress file (not --once): its status view; it must
    end cleanly on SIGUSR1."""
    fetcher = start(stage, secret)
    try:
        yield status(stage)
    finally:
        progress.close()
        fetcher.send_signal(signal.SIGUSR1)
        _, err = fetcher.communicate(timeout=15)
    assert fetcher.returncode == 0, err


def wait_for_field(view: StatusView, name: str, value: int) -> None:
    deadline = time.monotonic() + 20
    while view.field(name) < value and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # and no more than that
    assert view.field(name) == value, name


def test_a_file_its_home_has_not_read_yet_holds_back_no_other_fetch(home, tmp_path):
    """Each fetch waits for its own home's read (the plan's ready tick): the first file needed
    after the ranks' position, planned from a read the home makes far later, waits, and every
    file behind it is fetched meanwhile. (Before, that one file held back every copy behind it
    until the ranks passed its tick, so later epochs' fetches bunched at each epoch's start.)"""
    ds, address, secret, _ = home
    at = 1  # the ranks' position: the homes have read every file of step 0 (ready tick 0)
    spec = SamplerSpec(num_samples=len(ds), world_size=1, seed=0, shuffle="global")
    first_use = [t[0] for t in plan_for_node(ds, spec, 4, (0, 1), (0,), 1).ticks]
    ahead = [i for i, tick in enumerate(first_use) if tick >= at]  # first-use order
    late = ahead[0]
    plan, progress = fetcher_at(ds, tmp_path / "b", address, 4, at, {late: 10**6})
    with running_fetcher(tmp_path / "b", secret, progress) as view:
        wait_for_field(view, "peer_files", len(ahead) - 1)
        assert view.field("pfs_opens") == 0
        assert view.state(int(plan.file_ids[late])) == PENDING


def test_not_here_is_asked_again_while_the_use_is_ahead_then_the_pfs(home, tmp_path):
    """A peer that does not hold a file yet (its stager behind its ranks; here: its copy
    written since it was published, which it never serves) is asked again once the ranks move,
    not left for the PFS, while the use is more than --protect-steps (4) ahead; then the PFS
    copy, counted as one fallback."""
    ds, address, secret, _ = home
    at, batch = 1, 1
    plan, progress = fetcher_at(ds, tmp_path / "b", address, batch, at, {})
    target = next(i for i in range(plan.files) if plan.ticks[i][0] > at + 4 + 2)
    home_copy = tmp_path / "a" / "k" / ds.files[int(plan.file_ids[target])].relpath
    os.utime(home_copy, ns=(home_copy.stat().st_atime_ns, home_copy.stat().st_mtime_ns + 10**9))
    ahead = sum(1 for t in plan.ticks if t[0] >= at)
    with running_fetcher(tmp_path / "b", secret, progress) as view:
        wait_for_field(view, "peer_files", ahead - 1)
        assert view.field("pfs_opens") == 0 and view.field("peer_fallbacks") == 0
        assert view.state(int(plan.file_ids[target])) == PENDING
        progress.set(0, int(plan.ticks[target][0]) - 4)  # the use is near: the PFS now
        wait_for_field(view, "pfs_opens", 1)
        assert view.field("peer_fallbacks") == 1 and view.field("peer_files") == ahead - 1
        assert view.state(int(plan.file_ids[target])) == READY
    copy = tmp_path / "b" / "k" / ds.files[int(plan.file_ids[target])].relpath
    assert copy.read_bytes() == (ds.root / copy.relative_to(tmp_path / "b" / "k")).read_bytes()


def test_a_connection_without_the_secret_is_refused_with_one_line(home, tmp_path):
    ds, address, _, proc = home
    view, err = fetch(ds, tmp_path, address, secrets.token_hex(32))
    assert view.field("peer_files") == 0 and view.field("pfs_opens") == FILES
    assert view.field("peer_fallbacks") == FILES
    assert "is not asked again" in err
    assert_copies_are_the_sources(ds, tmp_path / "b")
    with socket.create_connection(("127.0.0.1", int(address.split(":")[1])), timeout=5) as raw:
        raw.sendall(b"GET / HTTP/1.0\r\n\r\n" + bytes(64))
        raw.recv(64)
    proc.send_signal(signal.SIGUSR1)
    _, log = proc.communicate(timeout=15)
    assert [line for line in log.splitlines() if REFUSED in line] == [
        line for line in log.splitlines() if "refused" in line
    ]
    assert sum(REFUSED in line for line in log.splitlines()) == 1, log


@pytest.mark.parametrize("verify", [False, True])
def test_a_damaged_copy_on_the_peer_is_not_used(tmp_path, verify):
    """A rewritten, a truncated and a symlinked copy on the home: the PFS is read for those;
    with --stage-verify, also for a rewrite whose mtime was put back (only a checksum sees it)."""
    ds = make_tree(tmp_path / "pfs", FILES, 3000)
    listener = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    secret = secrets.token_hex(32)
    write_plan(ds, tmp_path / "a", 0, None)
    flags = ("--verify",) if verify else ()
    proc = start(tmp_path / "a", secret, listener, *flags)
    listener.close()
    view = status(tmp_path / "a")
    deadline = time.monotonic() + 30
    while view.field("plan_ready") < FILES:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    staged = [tmp_path / "a" / "k" / f.relpath for f in ds.files]
    rewritten, truncated, hidden = staged[0], staged[1], staged[2]
    rewritten.write_bytes(bytes(len(rewritten.read_bytes())))
    truncated.write_bytes(truncated.read_bytes()[:100])
    st = hidden.stat()
    hidden.write_bytes(bytes(st.st_size))
    os.utime(hidden, ns=(st.st_atime_ns, st.st_mtime_ns))
    # A copy replaced by a symlink to another file of the same size and mtime: never followed.
    linked = staged[3]
    private = tmp_path / "private"
    private.write_bytes(b"p" * linked.stat().st_size)
    os.utime(private, ns=(linked.stat().st_atime_ns, linked.stat().st_mtime_ns))
    linked.unlink()
    linked.symlink_to(private)
    try:
        got, _ = fetch(ds, tmp_path, address, secret, *flags)
    finally:
        proc.send_signal(signal.SIGUSR1)
        proc.wait(timeout=15)
    damaged = 4 if verify else 3
    assert got.field("peer_fallbacks") == damaged and got.field("pfs_opens") == damaged
    assert got.field("peer_files") == FILES - damaged
    if verify:
        assert_copies_are_the_sources(ds, tmp_path / "b")
    else:  # without a checksum the mtime-preserving rewrite is not seen: the documented limit
        for f in [f for k, f in enumerate(ds.files) if k != 2]:
            copy = tmp_path / "b" / "k" / f.relpath
            assert copy.read_bytes() == (ds.root / f.relpath).read_bytes()


def test_a_dead_peer_costs_no_wait_and_a_silent_one_a_bounded_one(home, tmp_path):
    ds, address, secret, proc = home
    proc.kill()  # the peer's stager killed: connections are refused at once
    proc.wait(timeout=10)
    started = time.monotonic()
    view, err = fetch(ds, tmp_path, address, secret)
    assert view.field("pfs_opens") == FILES and view.field("peer_fallbacks") == FILES
    assert time.monotonic() - started < 10
    assert sum("is not asked again" in line for line in err.splitlines()) == 1, err
    assert_copies_are_the_sources(ds, tmp_path / "b")

    silent = socket.create_server(("127.0.0.1", 0))  # accepts connections, never answers
    try:
        started = time.monotonic()
        other = tmp_path / "c"
        write_plan(ds, other, 1, f"127.0.0.1:{silent.getsockname()[1]}")
        quiet = start(other, secret, None, "--once")
        _, err = quiet.communicate(timeout=60)
        took = time.monotonic() - started
    finally:
        silent.close()
    assert quiet.returncode == 0, err
    assert status(other).field("pfs_opens") == FILES
    assert 4.5 < took < 30, f"{took:.1f} s"  # one 5 s I/O timeout per thread, in parallel
    assert_copies_are_the_sources(ds, other)


def test_a_full_stage_dir_on_the_fetching_node_stops_growing_with_no_wrong_bytes(home, tmp_path):
    """The fetching node's stage dir is a 64 KiB tmpfs: peer copies land until it is full, then
    the ENOSPC rule of PFS copies holds (NOSPACE, no temporary file left, no partial copy)."""
    if os.geteuid() != 0:
        pytest.skip("a small tmpfs in a private mount namespace needs root")
    ds, address, secret, _ = home
    write_plan(ds, tmp_path / "b", 1, address)
    out, mnt = tmp_path / "out", tmp_path / "mnt"
    out.mkdir()
    mnt.mkdir()
    stager = [str(find_stager_binary()), "--stage-dir", str(mnt), "--session", SESSION]
    stager += ["--threads", "4", "--peer", "--once", "--capacity", "10000000"]
    meta = mnt / ".hpcdl" / "sessions" / SESSION
    script = (
        f"mount -t tmpfs -o size=64k,mode=0700 hpcdl-test {mnt} && mkdir -p {meta} && "
        f"cp {tmp_path / 'b' / '.hpcdl' / 'sessions' / SESSION / 'plan'} {meta}/plan && "
        f"{shlex.join(stager)}; rc=$?; cp {meta}/status {out}/status; ls -a {meta} > {out}/meta; "
        f"(cd {mnt} && find k -type f -exec sha256sum {{}} +) > {out}/sums; exit $rc"
    )
    proc = subprocess.run(
        ["unshare", "--mount", "sh", "-c", script],
        input=secret + "\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "No space left on device" in proc.stderr, proc.stderr
    view = StatusView(out / "status")
    assert view.open() and view.has_flag("NOSPACE")
    landed = view.field("peer_files")
    assert 0 < landed < FILES and view.field("pfs_opens") == 0
    sums = dict(
        reversed(line.split(maxsplit=1)) for line in (out / "sums").read_text().splitlines()
    )
    assert len(sums) == landed
    for rel, digest in sums.items():
        source = ds.root / rel.removeprefix("k/")
        assert digest == hashlib.sha256(source.read_bytes()).hexdigest(), rel
    assert not [n for n in (out / "meta").read_text().split() if n.startswith("tmp.")]


# ---------------------------------------------------------------- peers that are not honest
# (issue 51): an impostor on a dead peer's port, strangers that trickle, a peer that trickles.


def forged_reply(ds, request: bytes) -> bytes:
    """What a squatter that knows the wire format sends for a request of the first protocol
    version: the source's real metadata (no read permission needed), forged bytes, a checksum
    trailer over them."""
    file_id, _, size = struct.unpack_from("<IIQ", request, 40)
    st = (ds.root / ds.files[file_id].relpath).stat()
    body = b"F" * size
    digest = 14695981039346656037
    for byte in body:
        digest = ((digest ^ byte) * 1099511628211) & (2**64 - 1)
    header = struct.pack("<II6Q", 0, 0, size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino,
                         st.st_dev, 0)  # fmt: skip
    return b"HPCDLPA1" + header + body + struct.pack("<Q", digest)


class Impostor:
    """A process without the job's secret that took a dead stager's port: it records every byte
    a fetcher sends it and either forges replies ("forge") or relays the connection to a live
    stager of the job ("relay", a man in the middle)."""

    def __init__(self, port: int, mode: str, ds, live_port: int):
        self.mode, self.ds, self.live_port = mode, ds, live_port
        self.received = bytearray()
        self.server = socket.create_server(("127.0.0.1", port))
        self.server.settimeout(0.2)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.server.accept()
            except OSError:
                continue
            target = self._relay if self.mode == "relay" else self._forge
            threading.Thread(target=target, args=(conn,), daemon=True).start()

    def _forge(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(5)
            with contextlib.suppress(OSError):
                while data := conn.recv(65536):
                    self.received += data
                    if data.startswith(b"HPCDLPQ1"):  # the first version: forge its reply
                        conn.sendall(forged_reply(self.ds, data))
                    else:  # a handshake: the best a squatter can do is a made-up proof
                        conn.sendall(b"HPCDLPS2" + os.urandom(64))

    def _relay(self, conn: socket.socket) -> None:
        with conn, socket.create_connection(("127.0.0.1", self.live_port), timeout=5) as live:
            conn.settimeout(5)

            def down() -> None:
                with contextlib.suppress(OSError):
                    while data := live.recv(65536):
                        conn.sendall(data)
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_WR)

            threading.Thread(target=down, daemon=True).start()
            with contextlib.suppress(OSError):
                while data := conn.recv(65536):
                    self.received += data
                    live.sendall(data)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.server.close()


def squat_on_a_dead_stagers_port(ds, stage: Path, secret: str, mode: str, live_port: int):
    """A stager that served on a port is SIGKILLed (the test, like a node leader that already
    closed its copy, holds no descriptor of the socket); an Impostor binds the freed port."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    write_plan(ds, stage, 0, None)
    dead = start(stage, secret, listener)
    listener.close()
    status(stage)  # it runs, and holds the socket
    dead.kill()
    dead.communicate(timeout=10)
    return Impostor(port, mode, ds, live_port), f"127.0.0.1:{port}"


@pytest.mark.parametrize("mode", ["forge", "relay"])
def test_an_impostor_on_a_dead_peers_port_gets_no_secret_and_publishes_nothing(
    home, tmp_path, mode
):
    """Issue 51, break 1: the fetcher proves nothing to a server that has not proved the job's
    secret first, so the squatter learns nothing it could replay to a live home; neither
    forged replies nor a relay to a live stager of the job (which proves its own address, not
    the dead one's) are published, and the file comes from the PFS."""
    ds, live_address, secret, live = home
    live_port = int(live_address.split(":")[1])
    impostor, address = squat_on_a_dead_stagers_port(ds, tmp_path / "dead", secret, mode, live_port)
    try:
        view, err = fetch(ds, tmp_path, address, secret)
    finally:
        impostor.close()
    received = bytes(impostor.received)
    assert received, "the fetcher never reached the impostor"
    assert bytes.fromhex(secret) not in received and secret.encode() not in received
    assert view.field("peer_files") == 0 and view.field("pfs_opens") == FILES, err
    assert "is not asked again" in err
    assert_copies_are_the_sources(ds, tmp_path / "b")
    # What the impostor captured, replayed to the live home, gets no file from it.
    with socket.create_connection(("127.0.0.1", live_port), timeout=5) as replay:
        replay.sendall(received[:4096])
        with contextlib.suppress(OSError):
            while replay.recv(65536):
                pass
    live.send_signal(signal.SIGUSR1)
    _, log = live.communicate(timeout=15)
    assert "refused a peer connection from 127.0.0.1" in log, log
    assert status(tmp_path / "a").field("files_served") == 0


def test_six_trickling_strangers_do_not_stop_a_real_fetch(home, tmp_path):
    """Issue 51, break 2: six connections without the secret, each sending a byte a second
    (and connecting again when closed), while a real peer fetches every file from the home:
    the serving threads are not theirs, and every file comes from the home."""
    ds, address, secret, _ = home
    port = int(address.split(":")[1])
    stop, bytes_sent = threading.Event(), [0] * 6

    def stranger(k: int) -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port)) as s:
                for byte in b"HPCDLPQ1" + bytes(48):  # a request of a wrong secret, trickled
                    s.sendall(bytes([byte]))
                    bytes_sent[k] += 1
                    if stop.wait(1.0):
                        return

    strangers = [threading.Thread(target=stranger, args=(k,), daemon=True) for k in range(6)]
    for t in strangers:
        t.start()
    try:
        deadline = time.monotonic() + 20
        while min(bytes_sent) < 2:  # every stranger is connected and trickling
            assert time.monotonic() < deadline, bytes_sent
            time.sleep(0.05)
        view, err = fetch(ds, tmp_path, address, secret)
    finally:
        stop.set()
        for t in strangers:
            t.join(timeout=5)
    assert view.field("peer_files") == FILES and view.field("pfs_opens") == 0, err
    assert view.field("peer_fallbacks") == 0
    assert_copies_are_the_sources(ds, tmp_path / "b")


class TricklingPeer:
    """A proxy in front of a real home: the client's bytes pass at once, the home's first
    `fast` bytes too (the handshake and a reply's header), then one byte a second."""

    def __init__(self, home_port: int, fast: int = 200):
        self.home_port, self.fast = home_port, fast
        self.server = socket.create_server(("127.0.0.1", 0))
        self.server.settimeout(0.2)
        self.port = self.server.getsockname()[1]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.server.accept()
            except OSError:
                continue
            home = socket.create_connection(("127.0.0.1", self.home_port), timeout=5)
            threading.Thread(target=self._pipe, args=(conn, home), daemon=True).start()
            threading.Thread(target=self._trickle, args=(home, conn), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)

    def _trickle(self, src: socket.socket, dst: socket.socket) -> None:
        sent = 0
        with contextlib.suppress(OSError), src, dst:
            while data := src.recv(65536):
                for k in range(len(data)):
                    if sent >= self.fast and self.stop.wait(1.0):
                        return
                    dst.sendall(data[k : k + 1])
                    sent += 1

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.server.close()


def test_a_trickling_peer_is_given_up_within_the_deadline_and_the_pfs_gives_the_file(
    home, tmp_path
):
    """Issue 51, break 3: a peer that sends its header and then a byte a second never trips a
    per-read timeout; the fetch's whole-transfer deadline (docs/staging.md, "Deadlines") gives
    it up, the peer is marked down, and every file comes from the PFS (the stager ends, where
    it waited for hours before: the 60 s guard below is a hang check, not a timing)."""
    ds, address, secret, _ = home
    proxy = TricklingPeer(int(address.split(":")[1]))
    write_plan(ds, tmp_path / "b", 1, f"127.0.0.1:{proxy.port}")
    proc = start(tmp_path / "b", secret, None, "--once")
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        proxy.close()
    assert proc.returncode == 0, err
    view = status(tmp_path / "b")
    assert view.field("peer_files") == 0 and view.field("pfs_opens") == FILES, err
    assert "deadline" in err and "is not asked again" in err, err
    assert_copies_are_the_sources(ds, tmp_path / "b")
