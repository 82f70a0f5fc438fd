"""`bench calibrate`'s contention figure: the training time a node loses per file its stager copies.

A stager copies while the ranks train: epoch 1's files, and in every later epoch of a global
shuffle the next epoch's new files, from the PFS or from peers. Where the ranks and loaders keep
the node's cores busy (and on emulated nodes that share one host's cores), the copies take CPU
time, memory bandwidth and the file system client's attention from the steps. On a node with
cores to spare the figure is about 0, which is what it then measures.

It is measured, not derived: the trainer's step (bench calibrate's loop, batch building
included) is timed once quiet and once while every node's leader runs a real hpcdl-stage that
copies files of --data into a fresh temporary directory of --stage-dir with --threads copy
threads, started as the timed steps begin. The timed steps go on, in windows of --steps steps,
until every node's copies have all been published (load_goes_on; at most LOAD_CAP_S, after
which the figure is not measured): so they cover the whole load, where one window ended with
copies still in flight, or none landed yet, as the copier's start outlasted a window of short
steps. The steps' added seconds, over the copies published (the stager's count of them, read
from its status map as the steps end), give seconds per file and node. At most --local-mb MB
is copied; the directory is removed afterwards, with any stage dir made for it
(hpcdl.bench.stage_scratch). A copier that fails leaves the figure at 0, its last line in the
calibration's note.

A peer fetch is timed apart (measure_fetch_contention): every node leader's hpcdl-stage first
stages the same files as its node's home and serves them on its node's address (as the job's
stager does), and as the timed steps begin a second hpcdl-stage on every node fetches the
previous node's (node k from node k-1) with --threads copy threads, all of them released at
once. That is how a job's stager fetches: its plan, rewritten as every epoch starts, releases
the next epoch's fetches together (their homes have read the files by then), and it fetches
them as fast as its threads go. Every node serves as many files as it fetches, as in a job.
With one node, or a node whose address cannot be bound, there is no peer and the figure is not
measured (None: the model charges a fetch what a PFS copy costs). Both stagers of the fetch run
STAGE_NICE_LATER steps nicer than the ranks, as a job's stager does by default once its ranks
pass the first epoch (--stage-nice auto): a job fetches from peers only from epoch 2 on.

Both are measured, not derived: on a busy node the steps lose far more than the copies' CPU
time (a copy wakes threads that take a core from a rank, and the other ranks wait for it in
the allreduce), and how much depends on how the copies come. On the 2-core test VM a fetch
costs the two stagers about 0.2 ms of CPU; in the 4-node peer-staging bench's setup the steps
lost 0.1-4.4 ms per fetch when the fetches came all at once, and 5-14 ms when they came a few
per step.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hpcdl.bench.calibrate_peer import (
    SESSION,
    WAIT_S,
    start_stager,
    status_path,
    stopped_saying,
    wait_ready,
    write_plan,
)
from hpcdl.bench.stage_scratch import scratch_dir
from hpcdl.comm.failure import UserError
from hpcdl.config import STAGE_NICE_LATER
from hpcdl.staging.binary import find_stager_binary
from hpcdl.staging.peer_tier import open_listener
from hpcdl.staging.plan import FileTreeDataset
from hpcdl.staging.status import StatusView

MIN_FILES = 64  # copied per node at least: a window of a few steps must see some land
# The loaded steps run on until the load has landed, for at most this long (seconds): a load of
# --local-mb MB that takes longer is the file system's trouble, not a figure of the steps.
LOAD_CAP_S = 60.0


@dataclass(frozen=True)
class Window:
    """Step times of a timed run and when (time.time()) its timed steps began and ended."""

    seconds: list[float]
    began: float
    ended: float
    unfinished: bool = False  # the load beside them had not all landed at LOAD_CAP_S


def load_goes_on(comm: Any, beside: Any, began: float) -> tuple[bool, bool]:
    """(another window of steps, the load still pending) after a window of loaded steps that
    began (time.time()) at `began`, agreed over comm: on while any rank's load is pending
    (beside.pending()) and no rank has seen LOAD_CAP_S pass. Collective."""
    from mpi4py import MPI  # noqa: PLC0415

    flags = np.array([beside.pending(), time.time() - began >= LOAD_CAP_S], np.int32)
    comm.Allreduce(MPI.IN_PLACE, flags, op=MPI.MAX)
    pending, over = bool(flags[0]), bool(flags[1])
    return pending and not over, pending


def start_copier(data: Path, stage: Path, relpaths: list[str], sizes: list[int], threads: int):
    """hpcdl-stage copying these files of data into stage (one epoch, --once), started: the
    caller's steps run beside its start too, as beside the fetching stager's (waiting here for
    its status map let a fast copier publish some or all of its copies before the steps, which
    then left them out, or measured nothing)."""
    write_plan(FileTreeDataset.of_files(data, relpaths, sizes), stage, 0, None)
    cmd = [str(find_stager_binary()), "--stage-dir", str(stage), "--session", SESSION,
           "--threads", str(threads), "--once", "--quiet"]  # fmt: skip
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


@dataclass(frozen=True)
class CopyLoad:
    """What the copies are: these files of --data (relative paths, sizes; chosen by bench
    calibrate, empty on ranks that copy nothing), with `threads` copy threads."""

    data: Path
    threads: int
    relpaths: list[str]
    sizes: list[int]


def measure_contention(
    world: Any,
    load: CopyLoad,
    stage_dir: Path,
    quiet_step_s: float,
    timed: Callable[[Any], Window],
) -> tuple[float, str]:
    """(seconds lost per file a node copies, 0 where not measured; a note) on every rank;
    collective.

    quiet_step_s: the trainer's mean step without copies; timed(beside): runs the trainer's
    steps, calls beside.start() as the timed ones begin (the copies start then, after the
    warm-up), and returns their Window."""
    with contextlib.ExitStack() as scratch:
        copies = None
        if world.local_rank == 0:
            where = scratch.enter_context(scratch_dir(stage_dir, ".hpcdl-calibrate-contention."))
            copies = Copies(load, where)
        per_copy, note = _timed_copies(world, quiet_step_s, timed, copies, "copies")
    return (0.0 if per_copy is None else per_copy), note


def measure_fetch_contention(
    world: Any,
    load: CopyLoad,
    stage_dir: Path,
    quiet_step_s: float,
    timed: Callable[[Any], Window],
) -> tuple[float | None, str]:
    """(seconds lost per file a node fetches from a peer, and serves to one; None where not
    measured, a note) on every rank; collective. The arguments are measure_contention's; the
    load's files are each node's home copies, fetched by the next node."""
    if world.num_nodes < 2:
        return None, "not measured: one node has no peer"
    secret = world.comm.bcast(secrets.token_hex(32) if world.rank == 0 else None, root=0)
    with contextlib.ExitStack() as scratch:
        fetches, address, error = None, None, ""
        if world.local_rank == 0:
            where = scratch.enter_context(scratch_dir(stage_dir, ".hpcdl-calibrate-fetch."))
            fetches = scratch.enter_context(contextlib.closing(Fetches(load, where, secret)))
            address, error = fetches.serve()
        gathered = world.comm.allgather((world.local_rank, address, error))
        leaders = [(a, e) for local, a, e in gathered if local == 0]
        error = next((e for _, e in leaders if e), "")
        if error:
            return None, f"not measured: {error}"
        if fetches is not None:
            fetches.aim(leaders[(world.node_index - 1) % world.num_nodes][0])
        return _timed_copies(world, quiet_step_s, timed, fetches, "fetches")


class Idle:
    """Nothing beside the timed steps (a rank that is not its node's leader)."""

    def start(self) -> None:
        """Called as the timed steps begin."""

    def pending(self) -> bool:
        """Files of the load that have not landed yet, and may."""
        return False

    def stop(self) -> None:
        """Called as the timed steps end."""


class Counted(Idle):
    """A stager beside the timed steps whose copies published in between are counted from its
    status map (files_staged, peer fetches included): exact, where the copies' ctimes are not
    (Linux may stamp files from a clock a tick or more behind time.time())."""

    def __init__(self, stage: Path) -> None:
        self.stage = stage  # a fresh one: its stager, started with the steps, has copied nothing
        self.at_stop = 0

    def staged(self) -> int:
        """Copies the stager in self.stage has published so far (0 before its map is out)."""
        view = StatusView(status_path(self.stage))
        try:
            return int(view.field("files_staged")) if view.open() else 0
        finally:
            view.close()

    def stop(self) -> None:
        self.at_stop = self.staged()

    def landed(self) -> int:
        """Copies published while the timed steps ran."""
        return self.at_stop


class Copies(Counted):
    """hpcdl-stage copying the load's files of --data into a node-local directory, as fast as
    it goes from the start of the timed steps."""

    def __init__(self, load: CopyLoad, stage: Path) -> None:
        super().__init__(stage)
        self.load, self.procs = load, []
        self.failed = ""  # the copier's last line, where it ended with an error

    def start(self) -> None:
        if self.load.relpaths:
            self.procs.append(start_copier(self.load.data, self.stage, self.load.relpaths,
                                           self.load.sizes, self.load.threads))  # fmt: skip

    def pending(self) -> bool:
        running = bool(self.procs) and self.procs[0].poll() is None
        return running and self.staged() < len(self.load.relpaths)

    def close(self) -> None:
        for proc in self.procs:
            self.failed = self.failed or stop(proc, signal.SIGTERM)


class Fetches(Counted):
    """A node's two stagers for the peer fetch: its home, which stages the load's files from
    --data and serves them, and a client (another stage dir) that fetches the previous node's
    (--once: all at once); `stage` is the client's, where the fetched copies land."""

    def __init__(self, load: CopyLoad, where: Path, secret: str) -> None:
        super().__init__(where / "client")
        self.load, self.where, self.secret = load, where, secret
        self.home: subprocess.Popen | None = None
        self.client: subprocess.Popen | None = None
        self.failed = ""

    def dataset(self) -> FileTreeDataset:
        return FileTreeDataset.of_files(self.load.data, self.load.relpaths, self.load.sizes)

    def serve(self) -> tuple[str | None, str]:
        """Stage the load's files as this node's home and serve them on the address the peer
        tier binds (hpcdl.staging.peer_tier): ("ip:port", "") or (None, why not)."""
        listener, why = open_listener()
        if listener is None:
            return None, why
        try:
            write_plan(self.dataset(), self.where / "home", 0, None)
            self.home = start_stager(self.where / "home", self.secret, [], listener,
                                     self.load.threads)  # fmt: skip
            address = "{}:{}".format(*listener.getsockname()[:2])
        finally:
            listener.close()  # the home holds its own descriptor
        try:
            wait_ready(
                self.where / "home", self.home, len(self.load.relpaths), sum(self.load.sizes)
            )
        except UserError as exc:
            return None, str(exc)
        renice(self.home.pid, STAGE_NICE_LATER)  # staged at the ranks' priority, serves below
        return address, ""

    def aim(self, home: str) -> None:
        """The client's plan: every file of the load from the home at "ip:port"."""
        write_plan(self.dataset(), self.stage, 1, home)

    def start(self) -> None:
        self.client = start_stager(self.stage, self.secret,
                                   ["--once", "--nice", str(STAGE_NICE_LATER)], None,
                                   self.load.threads)  # fmt: skip

    def pending(self) -> bool:
        running = self.client is not None and self.client.poll() is None
        return running and self.staged() < len(self.load.relpaths)

    def close(self) -> None:
        if self.client is not None:
            fell_back = StatusView(status_path(self.stage))
            if fell_back.open() and fell_back.field("peer_fallbacks"):
                self.failed = f"{fell_back.field('peer_fallbacks')} fetches fell back to the PFS"
            fell_back.close()
            self.failed = self.failed or stop(self.client, signal.SIGTERM)
        if self.home is not None:
            self.failed = self.failed or stop(self.home, signal.SIGUSR1)


def renice(pid: int, more: int) -> None:
    """Every thread of process pid `more` steps nicer (niceness is per thread on Linux)."""
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):  # a thread that has ended since
            now = os.getpriority(os.PRIO_PROCESS, int(task))
            os.setpriority(os.PRIO_PROCESS, int(task), min(19, now + more))


def stop(proc: subprocess.Popen, sig: int) -> str:
    """Send sig to a stager still running and wait for it: "" where it ended with 0 or by
    sig, else how it failed (its exit status and last line)."""
    err = stopped_saying(proc, sig, WAIT_S)
    if proc.returncode in (0, -sig):
        return ""
    lines = err.strip().splitlines()
    return f"exit {proc.returncode}: {lines[-1] if lines else 'no message'}"


def _timed_copies(
    world: Any, quiet_step_s: float, timed, copies: Copies | Fetches | None, what: str
) -> tuple[float | None, str]:
    """(seconds per copy, None where not measured; a note) of the copies (or fetches: `what`)
    beside the timed steps."""
    from mpi4py import MPI  # noqa: PLC0415

    from hpcdl.bench.timing import slowest_rank_mean  # noqa: PLC0415

    landed, failed = 0, ""
    try:
        window = timed(copies if copies is not None else Idle())
        if copies is not None:
            landed = copies.landed()
    finally:
        if copies is not None:
            copies.close()
            failed = copies.failed
    loaded = slowest_rank_mean(world.comm, window.seconds)
    per_node = world.comm.allreduce(landed, op=MPI.SUM) / world.num_nodes
    failed = next((f for f in world.comm.allgather(failed) if f), "")
    if failed:
        return None, f"not measured: a node's hpcdl-stage failed ({failed})"
    if window.unfinished:
        return None, f"not measured: the {what} had not all landed after {LOAD_CAP_S:g} s of steps"
    if per_node < 1:
        return None, f"not measured: none of the {what} landed during the timed steps"
    lost = max(0.0, (loaded - quiet_step_s) * len(window.seconds))
    # per_node exactly as the figure divides by it (1.5 where the nodes saw 1 and 2 land)
    note = (f"step {loaded * 1e3:.1f} ms over {len(window.seconds)} steps while {per_node:g} "
            f"{what} per node landed in {window.ended - window.began:.2f} s, "
            f"{quiet_step_s * 1e3:.1f} ms quiet")  # fmt: skip
    return lost / per_node, note
