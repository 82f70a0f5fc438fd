"""Losing a node: name it, in one line, whoever ends the job.

NOTE [losing a node]
When every process of a node dies (its launcher daemon, ranks, stager and loaders; a node
that crashes or is fenced), Open MPI's mpirun ends the whole job at once: "PRTE has lost
communication with a remote daemon" or "A daemon failed to report back", and exit status 0
(Open MPI 5.0). What the surviving ranks print from then on is lost with mpirun's forwarding,
so hpcdl.comm.failure, which works through messages from a failing rank, never gets to speak,
and nothing says which node or ranks the job lost. A node that stops answering without its
connections closing (a hung kernel, a cut link) is noticed by mpirun only after its TCP
keepalive, minutes later.

So the nodes watch each other on connections of their own: every node leader (local rank 0)
but rank 0's holds one TCP connection to rank 0, made at start-up, idle afterwards, with TCP
keepalive probes every few seconds. Each end hands its connections to a small watcher process
(`python -m hpcdl.comm.node_watch`, in a session of its own): when the node's processes are
killed, mpirun, and Open MPI's own error handling in the surviving ranks ("Socket closed ...
MPI_ERRORS_ARE_FATAL"), end the surviving ranks within milliseconds, often before a thread
of theirs could say anything, while the watcher outlives them by design. A connection that
ends (the peer's processes died: the kernel closes their sockets) or stops answering keepalive
probes (KEEPALIVE_S) means that node is lost: rank 0's watcher reports every other node, the
watcher of node 1's leader reports rank 0's node. The report is one line, `hpcdl: node HOST
(ranks ...) was lost: ...`, written to mpirun's own stderr when the rank is mpirun's child (the
line then outlives mpirun's forwarding), else to the rank's stderr. mpirun's stderr is taken as
mpirun's very open file (pidfd_getfd), so the line shares mpirun's file offset: in a job log
(`> log 2>&1`) mpirun's next lines come after it. A reopened /proc/PID/fd/2 (the fallback, where
the kernel refuses pidfd_getfd) has an offset of its own, and mpirun's next lines, written at
mpirun's offset, overwrite the line: that is how a cut link's line vanished (issue 49).
Then the watcher tells its rank, which calls MPI_Abort: for a node that went silent rather than
dead, mpirun would otherwise wait minutes. It still waits, for the silent node's daemon, so the
watcher of a rank that is mpirun's child ends mpirun (SIGTERM, then SIGKILL) if it has not
exited LAUNCHER_GRACE_S later.

With --on-node-loss continue (hpcdl.comm.ulfm) a connection that ends may be lost ranks on a
node that stays up, which MPI recovers from: the watcher reports it (and the job ends) only if
mpirun ends within LAUNCHER_ENDS_S, as it does on a lost node's daemon. A silent node is
reported at once, as with stop.

Quiet when it should be: close() is collective (every rank tells its watcher QUIET, the ranks
meet in a barrier, and only then do the watchers exit and the connections close: a normal end
reports nothing), a rank that fails alone says so itself and
stops its watcher, and a rank that hears of another rank's failure (hpcdl.comm.failure: a
Python error, whose process then exits and closes its connection) stops its watcher before
that happens. A watcher whose rank is gone waits WATCHER_LINGER_S for a connection to end,
then exits.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from hpcdl import diag
from hpcdl.comm import failure

KEEPALIVE_S = (5, 2, 3)  # idle seconds, seconds between probes, probes: silent after ~11 s
CONNECT_S = 5.0  # how long start-up waits for every node's connection (then: watch off)
WATCHER_LINGER_S = 2.0  # a watcher whose rank is gone waits this long for a lost node
LAUNCHER_ENDS_S = 3.0  # --on-node-loss continue: mpirun ends this soon after a lost node
LAUNCHER_GRACE_S = (10.0, 5.0)  # after a report: mpirun's own exit, then after its SIGTERM
QUIET, LOST = b"q", b"L"  # rank -> watcher: stop without a report; watcher -> rank: abort
EXIT_NODE_LOST = 5
SYS_PIDFD_GETFD = 438  # the same number on every Linux architecture
LAUNCHERS = ("prterun", "mpirun", "mpiexec", "orterun")  # /proc/PID/comm of mpirun itself


class NodeWatch:
    """This rank's part of the watch; see the module notes. Collective to make and to close."""

    def __init__(self, world: Any, closed_is_lost: bool = True) -> None:
        """closed_is_lost=False (--on-node-loss continue): a connection that ends is left to
        MPI (ULFM recovers from lost ranks; Open MPI ends the job on a lost node); only a node
        that goes silent is reported and ends the job."""
        self.world = world
        self.closed_is_lost = closed_is_lost
        self._closing = False
        self._sockets: dict[int, socket.socket] = {}  # node index -> connection
        self._watcher: subprocess.Popen | None = None
        self._tell: int | None = None  # pipe to the watcher: QUIET stops it
        hosts = world.comm.allgather(socket.gethostname())
        self.nodes = [(hosts[ranks[0]], ranks) for ranks in world.ranks_by_node]
        if world.num_nodes < 2:
            return
        error = None
        try:
            self._connect(world)
            if self._sockets:
                self._start_watcher()
        except OSError as exc:
            error = f"{exc}"
        errors = world.comm.allgather(error)
        if any(errors):  # the watch is an extra; training goes on without it, said once
            self._stop_watcher()
            if world.is_root:
                first = next(e for e in errors if e)
                print(f"hpcdl: node watch off (cannot connect the nodes: {first})", flush=True)

    def _connect(self, world: Any) -> None:
        """Rank 0 listens; every other node's leader connects and says its node index.

        By address, not by name: rank 0 sends the IPv4 addresses of its interfaces (its host
        name last), and a leader connects to all at once and keeps the first that answers.
        Some sites' nodes reach each other by address but cannot resolve each other's names
        (or the name is a management network's): waiting on a name cost 30 s and then the
        watch (issue 36)."""
        listener, where = None, None
        if world.is_root:
            listener = socket.create_server(("", 0))
            listener.settimeout(CONNECT_S)
            where = (listener.getsockname()[1], [*interface_addresses(), self.nodes[0][0]])
        port, addresses = world.comm.bcast(where, root=0)
        try:
            if world.is_node_leader and not world.is_root:
                conn = connect_first(addresses, port, CONNECT_S)
                conn.sendall(struct.pack("!i", world.node_index))
                self._sockets[0] = conn
            elif listener is not None:
                while len(self._sockets) < world.num_nodes - 1:
                    conn, _ = listener.accept()
                    conn.settimeout(CONNECT_S)
                    try:
                        (node,) = struct.unpack("!i", _receive(conn, 4))
                    except ConnectionError:  # a leader's attempt at another address, dropped
                        conn.close()
                        continue
                    self._sockets[node] = conn
        finally:
            if listener is not None:
                listener.close()
        for conn in self._sockets.values():
            conn.settimeout(None)
            _keepalive(conn)

    def _start_watcher(self) -> None:
        """Hand the connections to the watcher process; a thread waits for its LOST."""
        tell_r, self._tell = os.pipe()
        told_r, told_w = os.pipe()
        console = _launcher_stderr()
        launcher = os.getppid() if console is not None else None
        watched = {conn.fileno(): node for node, conn in self._sockets.items()}
        spec = {
            "nodes": self.nodes,
            "watched": watched,
            "report_root": self.world.node_index == 1,
            "tell": tell_r,
            "told": told_w,
            "console": console if console is not None else 2,
            "launcher": launcher,
            "closed_is_lost": self.closed_is_lost,
        }
        fds = [*watched, tell_r, told_w, *([console] if console is not None else [])]
        try:
            self._watcher = subprocess.Popen(
                [sys.executable, "-m", "hpcdl.comm.node_watch", json.dumps(spec)],
                pass_fds=fds,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                start_new_session=True,  # out of reach of what ends this rank's process group
            )
        finally:
            for fd in (tell_r, told_w, *([console] if console is not None else [])):
                os.close(fd)
            for conn in self._sockets.values():
                conn.close()  # the watcher holds them now
            self._sockets = {}
        failure.on_failure_heard(self._quiet)
        threading.Thread(
            target=self._abort_when_told, args=(told_r,), name="hpcdl-node-watch", daemon=True
        ).start()

    def _abort_when_told(self, told: int) -> None:
        """The watcher reported a lost node: end the job (it may be silent, not dead)."""
        with contextlib.suppress(OSError):
            lost = os.read(told, 1) == LOST  # b"" when the watcher exits quietly
            os.close(told)
            if lost and not self._closing:
                diag.dump_flight("a node was lost (hpcdl.comm.node_watch)")
                self.world.comm.Abort(EXIT_NODE_LOST)

    def _quiet(self) -> None:
        """Stop the watcher without a report (no MPI: also runs on the failure-notice thread)."""
        self._closing = True
        if self._tell is not None:
            with contextlib.suppress(OSError):
                os.write(self._tell, QUIET)

    def close(self) -> None:
        """Every rank together: stop watching, then let the connections close (a normal end)."""
        self._quiet()
        self.world.comm.Barrier()
        self._stop_watcher()

    def abandon(self) -> None:
        """This rank leaves alone (it failed and says so itself): stop watching. The watcher
        exits when this process does (its pipe closes)."""
        self._quiet()

    def _stop_watcher(self) -> None:
        self._quiet()
        if self._tell is not None:  # after QUIET, the watcher exits when this pipe closes
            os.close(self._tell)
            self._tell = None
        if self._watcher is not None:
            try:
                self._watcher.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._watcher.kill()
                self._watcher.wait()
            self._watcher = None
        for conn in self._sockets.values():
            conn.close()
        self._sockets = {}


def interface_addresses() -> list[str]:
    """This host's IPv4 addresses, loopback left out (Linux: SIOCGIFADDR per interface)."""
    import fcntl  # noqa: PLC0415

    found = []
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(probe.fileno(), 0x8915, request)  # SIOCGIFADDR
            except OSError:  # no IPv4 address on this interface
                continue
            address = socket.inet_ntoa(reply[20:24])
            if not address.startswith("127."):
                found.append(address)
    finally:
        probe.close()
    return found


def connect_first(hosts: list[str], port: int, timeout: float) -> socket.socket:
    """A connection to the first of hosts (addresses or names) that answers on port; all are
    tried at once, so an unreachable address costs no time. OSError naming them all if none
    answers within timeout."""
    won: list[socket.socket] = []
    errors: dict[str, str] = {}
    lock = threading.Lock()

    def attempt(host: str) -> None:
        try:
            conn = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            with lock:
                errors[host] = exc.strerror or str(exc)
            return
        with lock:
            if won:
                conn.close()
            else:
                won.append(conn)

    threads = [threading.Thread(target=attempt, args=(h,), daemon=True) for h in hosts]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    while not won and len(errors) < len(hosts) and time.monotonic() < deadline:
        time.sleep(0.01)
    with lock:
        if won:
            return won[0]
        tried = ", ".join(f"{h} ({errors.get(h, 'timed out')})" for h in hosts)
    raise OSError(f"no answer from rank 0's node at {tried}")


def _receive(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        part = conn.recv(size - len(data))
        if not part:
            raise ConnectionError("a node's connection closed during start-up")
        data += part
    return data


def _keepalive(conn: socket.socket) -> None:
    idle, interval, probes = KEEPALIVE_S
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    with contextlib.suppress(AttributeError, OSError):  # Linux names; elsewhere the defaults
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, probes)


def _launcher_stderr() -> int | None:
    """mpirun's own stderr when this rank is its child (its very open file where the kernel
    allows, else reopened for appending; module notes); else None."""
    parent = os.getppid()
    try:
        if not _is_launcher(parent):
            return None
        shared = _take_fd(parent, 2)
        if shared is not None:
            return shared
        return os.open(f"/proc/{parent}/fd/2", os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
    except OSError:
        return None


def _take_fd(pid: int, fd: int) -> int | None:
    """A duplicate of process pid's descriptor fd (Linux >= 5.6 pidfd_getfd: the same open
    file, offset included), or None where the kernel or a ptrace policy refuses it."""
    import ctypes  # noqa: PLC0415

    try:
        pidfd = os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        taken = libc.syscall(SYS_PIDFD_GETFD, pidfd, fd, 0)  # the result is O_CLOEXEC
        return taken if taken >= 0 else None
    finally:
        os.close(pidfd)


# ------------------------------------------------------------------ the watcher process


def watch(spec: dict) -> int:
    """Wait until a watched connection ends or goes silent and report it, unless the rank
    said QUIET first; exit when the rank closes its end of the pipe (after QUIET: at once, so
    the connections close only once every rank is quiet), or WATCHER_LINGER_S after the rank
    is gone without a word (module notes)."""
    watched = {int(fd): node for fd, node in spec["watched"].items()}
    poller = select.poll()
    for fd in [*watched, spec["tell"]]:
        poller.register(fd, select.POLLIN | select.POLLERR | select.POLLHUP)
    quiet, deadline = False, None  # deadline: set once the rank is gone
    while True:
        left = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
        events = poller.poll(left)
        if not events:
            return 0
        # The rank's pipe first: QUIET is written before any connection may close.
        for fd, _ in sorted(events, key=lambda event: event[0] != spec["tell"]):
            if fd == spec["tell"]:
                said = os.read(fd, 1)
                if said == QUIET:
                    quiet = True
                    continue
                if quiet:
                    return 0
                poller.unregister(fd)  # the rank is gone: a lost node may still follow
                deadline = time.monotonic() + WATCHER_LINGER_S
                continue
            node = watched.pop(fd)
            poller.unregister(fd)
            if quiet or (node == 0 and not spec["report_root"]):
                continue  # node 1's watcher reports rank 0's node
            why, silent = _why(fd, spec["nodes"][node][1][0])
            if not silent and not spec["closed_is_lost"] and not _launcher_ends(spec):
                continue  # --on-node-loss continue, ranks lost: MPI's to handle (hpcdl.comm.ulfm)
            _report(spec, node, why)
            with contextlib.suppress(OSError):
                os.write(spec["told"], LOST)
            if spec["launcher"]:
                _end_launcher(int(spec["launcher"]))
            return 0


def _launcher_ends(spec: dict) -> bool:
    """With --on-node-loss continue, whether the connection that ended was a lost node's: Open
    MPI ends the job on a lost node's daemon, so mpirun (this rank's parent) exits within
    LAUNCHER_ENDS_S; after lost ranks alone it goes on. Unknown without mpirun: False."""
    if not spec["launcher"]:
        return False
    deadline = time.monotonic() + LAUNCHER_ENDS_S
    while time.monotonic() < deadline:
        if not _is_launcher(int(spec["launcher"])):
            return True
        time.sleep(0.05)
    return False


def _end_launcher(pid: int) -> None:
    """After MPI_Abort, mpirun still waits for a silent node's daemon (its TCP keepalive,
    minutes): past LAUNCHER_GRACE_S, SIGTERM, then SIGKILL, so the job ends and a batch
    script goes on to its last lines. Only while pid is still a launcher (not a reused pid)."""
    for sig, grace in zip((signal.SIGTERM, signal.SIGKILL), LAUNCHER_GRACE_S, strict=True):
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if not _is_launcher(pid):
                return
            time.sleep(0.2)
        with contextlib.suppress(OSError):
            os.kill(pid, sig)


def _is_launcher(pid: int) -> bool:
    try:
        name = Path(f"/proc/{pid}/comm").read_text().strip()
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return name.startswith(LAUNCHERS) and state != "Z"


def _why(fd: int, leader: int) -> tuple[str, bool]:
    """Why a watched connection woke the watcher: its leader ended, or the node went silent
    (then True)."""
    conn = socket.socket(fileno=fd)
    try:
        data = conn.recv(1)
    except TimeoutError:  # ETIMEDOUT: keepalive probes went unanswered
        idle, interval, probes = KEEPALIVE_S
        return f"it stopped answering (no reply for {idle + interval * probes} s)", True
    except OSError as exc:
        return f"rank {leader} there ended without a word ({exc.strerror or exc})", False
    finally:
        conn.detach()
    if data:
        return f"rank {leader} there sent what it never sends", False
    return f"rank {leader} there ended without a word (killed, or the node went down)", False


def _report(spec: dict, node: int, why: str) -> None:
    host, ranks = spec["nodes"][node]
    line = (
        f"hpcdl: node {host} (ranks {', '.join(map(str, ranks))}) was lost: {why}; the job "
        "ends. Resume on the nodes left with --resume auto (docs/multinode.md)\n"
    )
    with contextlib.suppress(OSError):
        os.write(spec["console"], line.encode())


if __name__ == "__main__":
    sys.exit(watch(json.loads(sys.argv[1])))
