"""The stager side of the peer tier: real hpcdl-stage processes serving each other over TCP.

A home stager stages a small tree from the "PFS" and serves it on a loopback socket that the
test hands over, as a node leader does; a second stager (another stage dir, another "node")
fetches the same files through the plan's peer section. Each fault the issue names ends with
every byte right and the PFS read instead (docs/staging.md, "Peer tier").
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import shlex
import signal
import socket
import struct
import subprocess
import time
from pathlib import Path

import pytest
from helpers import make_tree, stager_ran_on, wait_until, write_peer_plan
from peer_stagers import (
    FILES,
    SESSION,
    assert_copies_are_the_sources,
    client_proof,
    fetch,
    serving_home,
    start,
    status,
    wait_staged,
    write_plan,
)

from hpcdl.data.sampler import SamplerSpec
from hpcdl.staging.binary import find_stager_binary
from hpcdl.staging.manifest import read_manifest
from hpcdl.staging.plan import plan_for_node
from hpcdl.staging.status import ProgressFile, StatusView

PENDING, READY = 0, 2  # a file's states in the status map (docs/staging.md)
REFUSED = "refused a peer connection from 127.0.0.1: it did not prove the job's secret"


@pytest.fixture
def home(tmp_path):
    """A home stager that has staged every file and serves them: (ds, address, secret, proc)."""
    with serving_home(tmp_path) as served:
        yield served


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
    # the home publishes its counters with its heartbeat
    wait_until(lambda: served.field("files_served") >= FILES, 5, "the home's files_served")
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
    """The wire format (docs/staging.md, "Peer tier"): a handshake, then 40-byte requests and
    64-byte replies; a served reply's bytes end with their MAC; a "not here" leaves the
    connection open for the next request, a wrong proof is refused and closed."""
    ds, address, secret, _ = home
    port = int(address.split(":")[1])

    def request(file_id: int, size: int) -> bytes:  # the whole file
        return b"HPCDLPQ3" + struct.pack("<IIQQQ", file_id, 0, size, 0, size)

    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        proof, nonces = client_proof(conn, secret, address)
        for number, file_id in enumerate(range(3)):  # a size no file has: "not here"
            conn.sendall((proof if number == 0 else b"") + request(file_id, 1))
            reply = conn.recv(64, socket.MSG_WAITALL)
            assert reply[:8] == b"HPCDLPA3" and struct.unpack_from("<I", reply, 8) == (1,)
        size = ds.files[0].size
        conn.sendall(request(0, size))
        reply = conn.recv(64, socket.MSG_WAITALL)
        body, tag = conn.recv(size, socket.MSG_WAITALL), conn.recv(32, socket.MSG_WAITALL)
        assert struct.unpack_from("<I", reply, 8) == (0,)
        assert body == (ds.root / ds.files[0].relpath).read_bytes()
        signed = b"hpcdl-peer reply\0" + nonces + struct.pack("<Q", 3) + request(0, size)
        want = hmac.new(bytes.fromhex(secret), signed + reply + body, "sha256").digest()
        assert hmac.compare_digest(tag, want)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        proof, _ = client_proof(conn, secret, address)
        conn.sendall(bytes(32) + request(0, 1))  # not the proof
        reply = conn.recv(64, socket.MSG_WAITALL)
        assert reply[:8] == b"HPCDLPA3" and struct.unpack_from("<I", reply, 8) == (2,)
        try:  # refused, and closed (reset: our request after the proof was never read)
            rest = conn.recv(1)
        except ConnectionResetError:
            rest = b""
        assert rest == b""


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
    """Until the stager's counter `name` reaches value, and no further: once it does, the
    stager runs its loop (dispatching what is due) 0.3 s more, by its heartbeat, and the count
    must still be value."""
    wait_until(lambda: view.field(name) >= value, 20, f"{name} >= {value}")
    stager_ran_on(view, 0.3)
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
        with contextlib.suppress(ConnectionResetError):  # closed unread: reset
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
    wait_staged(proc, status(tmp_path / "a"))
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
