"""Loader worker processes filling a ring of shared-memory minibatch slots, delivered in order.

Workers are fresh interpreters (`python -m hpcdl.data.worker`), not forks of the training
process: a fork of a process that has initialised MPI (and maybe CUDA) is unsafe, and the
multiprocessing 'spawn'/'forkserver' methods re-import the parent's __main__ (hpcdl.train,
which would start MPI in the child). The MPI launcher's environment variables are removed from
the workers' environment so nothing in them can join the job.

Control: one stream socket per worker carrying fixed-size TASK/REPLY structs (32 bytes; an
error reply adds its text). Batch indices go into the slot itself. Dead workers are seen at
once (end of file on their socket) and raise WorkerDied naming the pid and the batch; the pool
does not respawn (a batch that kills a worker once would likely kill it again).

Silent workers (stopped, stuck in uninterruptible I/O on a hung file system, deadlocked) are
alive, so only a watchdog sees them: while the trainer waits for batch b, the worker that owns
b has been silent since its last reply (or since it was handed work when idle). At half of
`timeout_s` one warning line (hpcdl.messages.warn) names its pid, the batch and its process
state from /proc; at `timeout_s` LoaderTimeout is raised and every worker is stopped. No
heartbeats: a stopped or D-state process could not send them, and a busy one is what the
timeout must allow for.

Stop requests: `iterate(..., stop_requested)` is polled while waiting. Once it answers True (the
trainer caught Slurm's SIGTERM), the pool stops depending on its workers: it closes them and
returns the number of batches delivered, and the Loader builds the rest in its own process. A
stalled worker thus cannot keep the trainer from reaching its checkpoint.

NOTE [the next epoch]
Issue 48: each iteration used to start with every slot free and end with the workers idle, so
every epoch waited for a batch built from scratch before its first step, the workers with the
epoch's last batches worked while the others idled, and an epoch of fewer batches than workers
kept some idle throughout (`bench input` on an H100: 768 JPEGs in batches of 128 are 6 batches
for 8 workers; DataLoader's row there never ends an epoch). So a caller that knows what it will
ask for next passes it as `then` (an Upcoming): once this iteration's batches are all given out,
the free slots get the next one's first batches. The next iterate() takes those it was built
for (same epoch, train flag and indices) as they are; any other order first waits for the
workers to finish them and drops them (their slots are being written). Batches travel under a
ticket, a number unique to the pool, so the same epoch's batch k can be in flight twice. A
batch that cannot be built (DataError: a bad file) is reported when it is asked for, not when
its worker says so: an epoch whose own batches are good ends whole, its checkpoint written,
before a bad file among the next epoch's first batches stops the run.
"""

from __future__ import annotations

import os
import pickle
import selectors
import signal
import socket
import subprocess
import sys
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hpcdl import diag, messages, stop_signals
from hpcdl.data.dataset import DataError
from hpcdl.data.kinds import reopen_spec
from hpcdl.data.slots import (
    OP_BUILD,
    OP_DATA_ERROR,
    OP_DONE,
    OP_READY,
    OP_STOP,
    REPLY,
    TASK,
    SlotLayout,
    SlotRing,
    byte_views,
    recv_exact,
    slot_views,
)
from hpcdl.data.worker_cores import spawning_on

_LAUNCHER_ENV_PREFIXES = ("OMPI_", "PMIX_", "PMI_", "HYDRA_", "MPI_LOCALRANKID", "I_MPI_")
_POLL_S = 0.5
STOP_WAIT_S = 3.0
DRAIN_WAIT_S = 60.0
# /proc/PID/stat state letters, as a user reading the warning needs them
_STATES = {
    "R": "running",
    "S": "sleeping",
    "D": "waiting in uninterruptible I/O (a hung file system?)",
    "T": "stopped (SIGSTOP)",
    "t": "stopped by a debugger",
    "Z": "exited",
}


class LoaderFault(RuntimeError):
    """The loader's workers failed in a way the user must act on; the message says how."""


class WorkerDied(LoaderFault):
    """A loader worker process exited while the pool needed it."""


class LoaderTimeout(LoaderFault):
    """A loader worker stayed silent past the timeout while the loader waited for its batch."""


class WorkerFailed(RuntimeError):
    """A loader worker raised an unexpected exception (a bug); carries its traceback."""


def worker_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_ENV_PREFIXES)}
    package_parent = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_parent, env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")  # workers are the parallelism; no BLAS threads
    return env


@dataclass(frozen=True)
class WorkerOptions:
    """How a WorkerPool's processes build batches: every field but the slots and the data set.

    locate: picklable file_id -> Path (staging's Locator) or None. timeout_s: a worker silent
    this long on a batch the trainer waits for raises LoaderTimeout. cores: the CPUs the
    workers run on (None: this process's; hpcdl.data.worker_cores NOTE [worker cores]).
    """

    workers: int
    seed: int
    augment: str
    locate: Callable[[int], Any] | None
    skip_bad: bool
    timeout_s: float
    cores: frozenset[int] | None = None


@dataclass(frozen=True)
class Upcoming:
    """What the next iterate() will be asked for (NOTE [the next epoch])."""

    batches: list
    epoch: int
    train: bool


class WorkerPool:
    """K worker processes and `prefetch` slots for one Loader. Not thread-safe."""

    def __init__(self, ds, layout: SlotLayout, options: WorkerOptions) -> None:
        self.layout = layout  # layout.count slots: the batches in flight at most
        self.timeout_s = options.timeout_s  # silent this long on a batch awaited: LoaderTimeout
        self.cores = options.cores  # where the workers run (None: where this process does)
        self.ring = SlotRing(layout)
        try:
            config = pickle.dumps(
                dict(
                    dataset=reopen_spec(ds),
                    seed=options.seed,
                    augment=options.augment,
                    locate=options.locate,
                    skip_bad=options.skip_bad,
                    layout=layout,
                )
            )
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            self.ring.close()
            raise ValueError(f"locate must be picklable to use loader workers: {exc}") from None
        self.procs: list[subprocess.Popen] = []
        self.socks: list[socket.socket] = []
        self.selector = selectors.DefaultSelector()
        self.counts = {"local_reads": 0, "pfs_reads": 0, "bad_samples": 0}
        self.control_bytes = 0
        self.control_messages = 0
        self.closed = False
        # Batches travel under tickets (NOTE [the next epoch]): finished ones (ticket -> slot),
        # each worker's tickets in flight (oldest first), what each ticket is (epoch, batch
        # number: for messages), the slots free to give out, and the batches built ahead for
        # the next iteration (its Upcoming, their tickets). Since when each worker has been
        # silent (time.monotonic()), and the tickets whose stall was warned about.
        self._done: dict[int, int] = {}
        self._owner: dict[int, deque] = {w: deque() for w in range(options.workers)}
        self._what: dict[int, tuple[int, int]] = {}
        self._free: deque = deque(range(layout.count))
        self._ahead: tuple[Upcoming, list[int]] | None = None
        self._next_ticket = 0
        self._silent_since: list[float] = []
        self._warned: set[int] = set()
        self._failed: dict[int, str] = {}  # ticket -> DataError text, raised when asked for
        self._ready: set[int] = set()  # workers that said READY (errors before it: start-up)
        self._finalizer = weakref.finalize(self, _shutdown, self.procs, self.socks, self.ring)
        try:
            env = worker_env()
            for w in range(options.workers):
                self._start(w, config, env)
        except BaseException:
            self.close()
            raise

    def _start(self, w: int, config: bytes, env: dict[str, str]) -> None:
        parent_end, child_end = socket.socketpair()
        # blocked until the worker ignores them (NOTE [stop signals] in hpcdl/stop_signals.py)
        with spawning_on(self.cores), stop_signals.blocked_for_children():
            proc = subprocess.Popen(
                [sys.executable, "-m", "hpcdl.data.worker", str(child_end.fileno()),
                 str(self.ring.fd)],
                pass_fds=(child_end.fileno(), self.ring.fd),
                env=env,
                stdin=subprocess.DEVNULL,
            )  # fmt: skip
        child_end.close()
        self.procs.append(proc)
        self.socks.append(parent_end)
        self._silent_since.append(time.monotonic())  # until its READY: start-up can hang too
        parent_end.sendall(len(config).to_bytes(8, "little") + config)
        self.selector.register(parent_end, selectors.EVENT_READ, w)

    def iterate(
        self,
        batches,
        epoch: int,
        train: bool,
        stop_requested: Callable[[], bool] | None = None,
        then: Upcoming | None = None,
    ):
        """Yield (images (n, C, H, W) float32, labels (n,) int64) slot views in batch order.

        then: what the next iterate() will be asked for (NOTE [the next epoch]). Returns the
        number of batches yielded: fewer than len(batches) when stop_requested() answered True
        while the pool waited (it is closed then; see the module notes)."""
        if self.closed:
            raise RuntimeError("this loader was closed (after close() or a worker failure)")
        batches = [np.asarray(b, np.int64) for b in batches]
        tickets = self._adopt(batches, epoch, train)
        ahead: list[int] = []
        self._warned = set()
        held = None
        ok = False
        try:
            for b in range(len(batches)):
                if held is not None:  # the trainer has moved on from the previous batch
                    self._free.append(held)
                    held = None
                while self._free and len(tickets) < len(batches):
                    k = len(tickets)
                    tickets.append(self._issue(epoch, k, batches[k], train))
                while then is not None and self._free and len(ahead) < len(then.batches):
                    k = len(ahead)
                    ahead.append(self._issue(then.epoch, k, then.batches[k], then.train))
                if not self._wait_for(tickets[b], stop_requested):
                    self.close()
                    return b
                held = self._done.pop(tickets[b])
                del self._what[tickets[b]]
                if tickets[b] in self._failed:
                    self.close()
                    raise DataError(self._failed.pop(tickets[b]))
                yield self._views(held, len(batches[b]))
            ok = True
        finally:
            if held is not None:
                self._free.append(held)
            if ok:
                self._ahead = (then, ahead) if ahead else None
            elif not self.closed:
                self._drain_or_close(stop_requested)
        return len(batches)

    def _adopt(self, batches: list, epoch: int, train: bool) -> list[int]:
        """The tickets built ahead for these batches (NOTE [the next epoch]); batches built
        ahead for another order are waited for and their slots freed."""
        if self._ahead is None:
            return []
        (up, tickets), self._ahead = self._ahead, None
        if (up.epoch, up.train) == (epoch, train) and len(tickets) <= len(batches):
            if all(np.array_equal(batches[k], up.batches[k]) for k in range(len(tickets))):
                return tickets
        for t in tickets:
            self._wait_for(t, None)
            self._free.append(self._done.pop(t))
            del self._what[t]
            self._failed.pop(t, None)  # a bad batch nobody asks for
        return []

    def _views(self, slot: int, n: int):
        """(images (n, C, H, W) float32, labels (n,) int64) of a slot; a byte slot's images are
        (offsets, data) (hpcdl.data.slots.byte_views)."""
        if self.layout.byte_capacity:
            _, labels, _ = slot_views(self.ring.mm, self.layout, slot, n)
            return byte_views(self.ring.mm, self.layout, slot, n), labels
        _, labels, images = slot_views(self.ring.mm, self.layout, slot, n)
        return images, labels

    def _wait_for(self, ticket: int, stop_requested: Callable[[], bool] | None) -> bool:
        """Receive replies until a ticket's batch is done (True) or a stop is requested (False)."""
        with diag.span(diag.Kind.DATA_WAIT):  # the stall inspector sees this wait
            while ticket not in self._done:
                if stop_requested is not None and stop_requested():
                    return False
                self._receive()
                if ticket not in self._done:
                    self._watch(ticket)
            return True

    def _building(self, ticket: int) -> str:
        epoch, b = self._what[ticket]
        return f"while building batch {b} of epoch {epoch}"

    def _watch(self, ticket: int) -> None:
        """The watchdog: warn once at half the timeout, raise LoaderTimeout at the timeout,
        when the worker that owns the ticket's batch has been silent that long."""
        w = next(k for k, owned in self._owner.items() if ticket in owned)
        silent = time.monotonic() - self._silent_since[w]
        if silent < self.timeout_s / 2 or (silent < self.timeout_s and ticket in self._warned):
            return
        pid = self.procs[w].pid
        state = _process_state(pid)
        where = f"{self._building(ticket)} (process state: {state})"
        if silent < self.timeout_s:
            self._warned.add(ticket)
            messages.warn(
                f"loader worker pid {pid} has not answered for {self.timeout_s / 2:g} s {where}; "
                f"the loader gives up at {self.timeout_s:g} s (--loader-timeout)"
            )
            return
        self.close()
        raise LoaderTimeout(
            f"loader worker pid {pid} has not answered for {self.timeout_s:g} s {where}; all "
            "loader workers were stopped. A hung parallel file system or a stopped process is "
            "the usual cause; raise --loader-timeout if one batch can really take this long"
        )

    def _issue(self, epoch: int, batch: int, indices: np.ndarray, train: bool) -> int:
        """Give batch `batch` of `epoch` a free slot and the least busy worker; its ticket."""
        slot = self._free.popleft()
        ticket, self._next_ticket = self._next_ticket, self._next_ticket + 1
        self._what[ticket] = (epoch, batch)
        w = min(self._owner, key=lambda k: len(self._owner[k]))
        idx, _, _ = slot_views(self.ring.mm, self.layout, slot, len(indices))
        idx[:] = indices
        msg = TASK.pack(OP_BUILD, slot, epoch, ticket, len(indices), int(train))
        if not self._owner[w]:
            self._silent_since[w] = time.monotonic()  # an idle worker's silence starts now
        self._owner[w].append(ticket)  # before the send: a worker found dead by it is named so
        self._send(w, msg)
        return ticket

    def _send(self, w: int, msg: bytes) -> None:
        try:
            self.socks[w].sendall(msg)
        except OSError:
            self._died(w)
        self.control_bytes += len(msg)
        self.control_messages += 1

    def _receive(self) -> None:
        """Wait for one reply from any worker (or notice a dead one)."""
        events = self.selector.select(_POLL_S)
        if not events:
            for w, proc in enumerate(self.procs):
                if proc.poll() is not None:
                    self._died(w)
            return
        for key, _ in events:
            w = key.data
            head = recv_exact(self.socks[w], REPLY.size)
            if not head:
                self._died(w)
            self._silent_since[w] = time.monotonic()
            op, slot, ticket, local, pfs, bad, text_len = REPLY.unpack(head)
            text = recv_exact(self.socks[w], text_len).decode() if text_len else ""
            self.control_bytes += REPLY.size + text_len
            self.control_messages += 1
            if op == OP_READY:
                self._ready.add(w)
                continue
            if op == OP_DATA_ERROR and w in self._ready and ticket in self._owner[w]:
                self._failed[ticket] = text  # raised when its batch is asked for (notes)
                op = OP_DONE
                local = pfs = bad = 0
            if op != OP_DONE:
                self.close()
                raise (DataError if op == OP_DATA_ERROR else WorkerFailed)(text)
            self._owner[w].remove(ticket)
            self._done[ticket] = slot
            self.counts["local_reads"] += local
            self.counts["pfs_reads"] += pfs
            self.counts["bad_samples"] += bad

    def _died(self, w: int) -> None:
        proc = self.procs[w]
        try:
            code = proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        pending = self._owner.get(w)
        what = self._building(pending[0]) if pending else "while idle"
        oom = (
            " Out of memory is the usual cause of SIGKILL (check `dmesg`, lower --workers or "
            "--prefetch);"
            if code == -signal.SIGKILL
            else ""
        )
        self.close()
        raise WorkerDied(
            f"loader worker pid {proc.pid} died ({_exit_reason(code)}) {what}; all loader "
            f"workers were stopped.{oom} --workers 0 loads in the training process for debugging"
        )

    def _drain_or_close(self, stop_requested: Callable[[], bool] | None) -> None:
        """The consumer left mid-epoch: wait for outstanding batches so slots are clean; close
        instead when a worker fails, it takes DRAIN_WAIT_S, or a stop is requested (the job
        ends, and a stalled worker must not hold it up)."""
        deadline = time.monotonic() + DRAIN_WAIT_S
        try:
            while any(self._owner.values()) and time.monotonic() < deadline:
                if stop_requested is not None and stop_requested():
                    break
                self._receive()
        except Exception:  # a worker failed on a batch nobody will read
            pass
        if any(self._owner.values()):
            self.close()
            return
        # every batch given out is finished and nobody reads it: all slots are free again
        self._done, self._what, self._ahead, self._failed = {}, {}, None, {}
        self._free = deque(range(self.layout.count))

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.selector.close()
        self._finalizer()


def _shutdown(procs, socks, ring) -> None:
    for s in socks:
        try:
            s.sendall(TASK.pack(OP_STOP, 0, 0, 0, 0, 0))
        except OSError:
            pass
    deadline = time.monotonic() + STOP_WAIT_S
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            try:
                p.wait(timeout=STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                pass  # in uninterruptible I/O it dies when the I/O returns: do not hang on it
    for s in socks:
        s.close()
    ring.close()


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "no exit status"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def _process_state(pid: int) -> str:
    """What /proc says the process is doing, in words; "unknown" off Linux."""
    try:
        letter = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "unknown"
    return _STATES.get(letter, letter)
