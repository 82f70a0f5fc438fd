"""What the peer tier's stager tests share (test_staging_peer_copy.py and
test_staging_peer_hostile.py): a home stager serving a small tree on a loopback socket that the
test hands over as a node leader does, and a second stager (another stage dir, another "node")
fetching through the plan's peer section."""

from __future__ import annotations

import collections
import contextlib
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from helpers import make_tree, wait_until, write_peer_plan

from hpcdl.staging.binary import find_stager_binary
from hpcdl.staging.status import StatusView

FILES = 24
SESSION = "job"


def write_plan(ds, stage: Path, node: int, peer_address: str | None) -> None:
    """One node's plan of every file; with peer_address, every file is fetched from node 0."""
    write_peer_plan(ds, stage, SESSION, node, peer_address)


def start(stage: Path, secret: str, listener: socket.socket | None = None, *flags: str):
    """hpcdl-stage --peer in stage's session with 4 threads; the secret goes to its stdin and
    `listener`, when given, is handed over as a node leader hands it."""
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
    """The session's status map in stage, once it exists."""
    view = StatusView(stage / ".hpcdl" / "sessions" / SESSION / "status")
    wait_until(view.open, 10, f"a status map in {stage}")
    return view


def wait_staged(proc: subprocess.Popen, view: StatusView) -> None:
    """Until the stager has staged every file; it must not exit meanwhile."""

    def staged() -> bool:
        assert proc.poll() is None, proc.stderr.read()
        return view.field("plan_ready") >= FILES

    wait_until(staged, 30, f"{FILES} files staged")


@contextlib.contextmanager
def serving_home(tmp_path: Path):
    """A home stager that has staged every file and serves them: (ds, address, secret, proc);
    stopped (SIGUSR1) at the end if it still runs."""
    ds = make_tree(tmp_path / "pfs", FILES, 3000)
    listener = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    secret = secrets.token_hex(32)
    write_plan(ds, tmp_path / "a", 0, None)
    proc = start(tmp_path / "a", secret, listener)
    listener.close()  # the stager holds its own descriptor
    wait_staged(proc, status(tmp_path / "a"))
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
    """Every copy in stage holds its source's bytes and mtime; no temporary file is left."""
    for f in ds.files:
        copy, source = stage / "k" / f.relpath, ds.root / f.relpath
        assert copy.read_bytes() == source.read_bytes(), f.relpath
        assert copy.stat().st_mtime_ns == source.stat().st_mtime_ns, f.relpath
    assert not [p for p in (stage / ".hpcdl" / "sessions" / SESSION).iterdir() if "tmp." in p.name]


def flood(port: int, rate: int, source: str, hello: bool, hold: int = 512) -> float:
    """A stranger at `source` (a loopback address) flooding 127.0.0.1:port with `rate` new
    connections a second, the last `hold` of them kept open, until SIGTERM: silent ones, or
    ones that send a valid hello (anyone can: it holds no secret) and then nothing. Returns the
    connections a second it opened."""
    stopped = []
    signal.signal(signal.SIGTERM, lambda *_: stopped.append(True))
    held: collections.deque[socket.socket] = collections.deque()
    opened, began = 0, time.monotonic()
    print("flooding", flush=True)
    while not stopped:
        due = int((time.monotonic() - began) * rate)
        while opened < due and not stopped:
            conn = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            conn.bind((source, 0))
            conn.settimeout(0.05 if hello else 0.0)
            with contextlib.suppress(OSError):  # in progress, refused or timed out: go on
                conn.connect(("127.0.0.1", port))
                if hello:
                    conn.sendall(b"HPCDLPH2" + secrets.token_bytes(32))
            held.append(conn)
            opened += 1
            if len(held) > hold:
                held.popleft().close()
        time.sleep(0.001)
    return opened / (time.monotonic() - began)


@contextlib.contextmanager
def flooding(port: int, rate: int, source: str = "127.0.0.1", hello: bool = False):
    """flood() in a process of its own (this file run as a script) for the with block, from its
    first connection on; yields a dict whose "rate", after the block, is the connections a
    second it achieved."""
    cmd = [sys.executable, __file__, "flood", str(port), str(rate), source, str(int(hello))]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    achieved: dict[str, float] = {}
    try:
        assert proc.stdout.readline() == "flooding\n", "the flood did not start"
        yield achieved
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    achieved["rate"] = float(out.split()[-1])


if __name__ == "__main__" and sys.argv[1:2] == ["flood"]:
    port, rate, source, hello = sys.argv[2:6]
    print(f"{flood(int(port), int(rate), source, hello == '1'):.0f}", flush=True)
