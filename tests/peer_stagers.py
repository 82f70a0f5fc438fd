"""What the peer tier's stager tests share (test_staging_peer_copy.py and
test_staging_peer_hostile.py): a home stager serving a small tree on a loopback socket that the
test hands over as a node leader does, and a second stager (another stage dir, another "node")
fetching through the plan's peer section."""

from __future__ import annotations

import collections
import contextlib
import hmac
import os
import secrets
import signal
import socket
import struct
import subprocess
import sys
import threading
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


class FakePeer:
    """A Python peer on 127.0.0.1:port (0: any) that serves each connection on a thread of its
    own with self.serve(conn), until close()."""

    def __init__(self, port: int = 0):
        self.server = socket.create_server(("127.0.0.1", port))
        self.server.settimeout(0.2)
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.server.accept()
            except OSError:
                continue
            threading.Thread(target=self.serve, args=(conn,), daemon=True).start()

    def serve(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.server.close()


class ProvingPeer(FakePeer):
    """A Python peer that holds the job's secret: it proves it, then answers each request on the
    connection with reply(request, number, nonces) (the bytes to send), counting connections
    and requests. The first `drop` connections it closes at once, unread; with hang_up, each
    connection after its first reply."""

    hang_up = False

    def __init__(self, ds, secret: str, drop: int = 0):
        self.ds, self.key, self.drop = ds, bytes.fromhex(secret), drop
        self.connections = self.requests = 0
        self.lock = threading.Lock()
        super().__init__()

    def serve(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError), conn:
            with self.lock:
                self.connections += 1
                if self.connections <= self.drop:
                    return
            conn.settimeout(5)
            hello = conn.recv(40, socket.MSG_WAITALL)
            nonces = hello[8:] + os.urandom(32)
            signed = b"hpcdl-peer server\0" + nonces + self.address.encode()
            proof = hmac.new(self.key, signed, "sha256").digest()
            conn.sendall(b"HPCDLPS2" + nonces[32:] + proof)
            request = conn.recv(32 + 40, socket.MSG_WAITALL)[32:]
            number = 0
            while len(request) == 40:
                with self.lock:
                    self.requests += 1
                conn.sendall(self.reply(request, number, nonces))
                if self.hang_up:
                    return
                number += 1
                request = conn.recv(40, socket.MSG_WAITALL)

    def header_and_body(self, request: bytes) -> tuple[bytes, bytes]:
        """A served reply's header (the source's identity) and the bytes of the source the
        request's range asks for."""
        file_id, _, size, offset, length = struct.unpack_from("<IIQQQ", request, 8)
        source = self.ds.root / self.ds.files[file_id].relpath
        st = source.stat()
        header = struct.pack("<II6Q", 0, 0, size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino,
                             st.st_dev, 0)  # fmt: skip
        return b"HPCDLPA3" + header, source.read_bytes()[offset : offset + length]

    def reply(self, request: bytes, number: int, nonces: bytes) -> bytes:
        """The honest reply: the bytes and their MAC (docs/staging.md, "Handshake")."""
        header, body = self.header_and_body(request)
        signed = b"hpcdl-peer reply\0" + nonces + struct.pack("<Q", number) + request
        return header + body + hmac.new(self.key, signed + header + body, "sha256").digest()


class ForgingPeer(ProvingPeer):
    """A peer that proves the job's secret (a damaged node, or one with the secret that lies)
    and answers every request with the source's metadata, forged bytes and a MAC that is not
    theirs."""

    def reply(self, request: bytes, number: int, nonces: bytes) -> bytes:
        header, body = self.header_and_body(request)
        return header + b"F" * len(body) + os.urandom(32)


def client_proof(conn: socket.socket, secret_hex: str, address: str) -> tuple[bytes, bytes]:
    """The client's side of the handshake (docs/staging.md, "Handshake"): checks the server's
    proof; returns (our proof, to send with the first request; both nonces)."""
    nonce = os.urandom(32)
    conn.sendall(b"HPCDLPH2" + nonce)
    hello = conn.recv(72, socket.MSG_WAITALL)
    assert hello[:8] == b"HPCDLPS2"
    nonces, key = nonce + hello[8:40], bytes.fromhex(secret_hex)
    server = hmac.new(key, b"hpcdl-peer server\0" + nonces + address.encode(), "sha256")
    assert hmac.compare_digest(hello[40:], server.digest())
    return hmac.new(
        key, b"hpcdl-peer client\0" + nonces + address.encode(), "sha256"
    ).digest(), nonces


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
