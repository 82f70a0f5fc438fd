"""StagingSession: the trainer's handle on the node's staging process.

Local rank 0 of each node leases the stage dir (hpcdl.staging.ownership), writes the plan into
its session dir, starts `hpcdl-stage` and stops it at the end; every local rank publishes its
consumption cursor and asks the status map where each file is. A dead stager is noticed through
its heartbeat: one warning, then every file not already staged is read from the PFS. Nothing
here blocks on the stager.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hpcdl.comm.failure import agree_on_errors
from hpcdl.comm.world import SoloComm
from hpcdl.config import STAGE_NICE, STAGE_THREADS
from hpcdl.data.dataset import FileTable
from hpcdl.data.sampler import SamplerSpec
from hpcdl.paths import nearest_existing
from hpcdl.stage_flags import parse_capacity_flag
from hpcdl.staging.binary import StagerNotFound, find_stager_binary
from hpcdl.staging.layout import SessionDir
from hpcdl.staging.outran import outran_warning
from hpcdl.staging.ownership import (
    StageDirError,
    StageDirFull,
    StageDirLease,
    check_no_overlap,
    data_key,
)
from hpcdl.staging.peer_tier import PeerTier, peer_tier_wanted
from hpcdl.staging.pieces import PieceSlots, piece_relpath, pieces_possible
from hpcdl.staging.plan import dataset_fingerprint
from hpcdl.staging.rolling_plan import RollingPlan
from hpcdl.staging.stager_process import CHECK_EVERY_S, StagerProcess
from hpcdl.staging.status import CounterFile, ProgressFile, StatusView, status_layout

PEER_COUNTERS = ("pfs_opens", "peer_files", "peer_bytes", "peer_fallbacks", "files_served")
# What a session says once (SaidOnce): the reading-from-the-PFS warning, the outran check.
PFS_FALLBACK, OUTRAN_CHECK = "pfs fallback", "outran check"


def parse_capacity(value: str | int | None, stage_dir: str | Path) -> int | None:
    """Bytes staging may use: int, '200G' (binary units), '80%' of free space; 0 stages nothing.

    None (or '') stays None: hpcdl-stage then uses its default (default_capacity()). A value
    the stager does not take is a ValueError naming --stage-capacity (hpcdl.stage_flags).
    """
    if value is None or value == "":
        return None
    capacity = parse_capacity_flag(value)
    if capacity.percent is None:
        return capacity.nbytes
    return capacity.resolve(shutil.disk_usage(nearest_existing(stage_dir)).free)


def default_capacity(stage_dir: str | Path) -> int:
    """The capacity hpcdl-stage uses without --capacity (it owns the rule), in bytes."""
    out = subprocess.run(
        [str(find_stager_binary()), "--default-capacity", str(nearest_existing(stage_dir))],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout)


@dataclass(frozen=True)
class StageOptions:
    """How one node stages: where, with how many copy threads, how much space, what to keep.

    capacity: bytes, '200G', '80%', 0 (stage nothing) or None (the stager's default: free space
    minus a margin). protect: flag -> data path the stage dir must not overlap (None: the data
    set root). keep: leave the copies (and the status map) at close. cores: the CPUs the stager
    runs on (None: the starting rank's; hpcdl.data.worker_cores NOTE [worker cores]).
    """

    stage_dir: str | Path
    threads: int = STAGE_THREADS
    nice: str = STAGE_NICE  # "auto" or "0".."19" (nice_flags)
    capacity: str | int | None = None
    keep: bool = False
    verify: bool = False
    protect: dict[str, Any] | None = field(default=None, hash=False)
    peers: str = "auto"  # --peer-staging: auto, on, off (hpcdl.staging.peer_tier)
    ranges: str = "auto"  # --peer-ranges: auto, on, off (hpcdl.staging.pieces)
    cores: frozenset[int] | None = None


class Locator:
    """Picklable `file_id -> Path`: the local copy when READY and present, else the PFS path.

    Counts hits and misses per process in the shared counters file, so loader worker processes
    are counted too. local_root is the data set's tree in the stage dir; meta its session dir.
    """

    def __init__(
        self,
        local_root: Path,
        meta: Path,
        root: Path,
        files: FileTable,
        local_rank: int,
        ranks: int,
    ):
        self.local_root = str(local_root)
        self.meta = str(meta)
        self.root = str(root)
        self._files = files  # a mapped index pickles as its path: workers share its pages
        self.local_rank = local_rank
        self.ranks = ranks
        self.layout = status_layout()  # pickled along: workers need not ask the binary
        self._status: StatusView | None = None
        self._counters: CounterFile | None = None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_status"] = state["_counters"] = None
        return state

    def relpath(self, file_id: int) -> str:
        return self._files.relpath(file_id)

    def __call__(self, file_id: int) -> Path:
        rel = self.relpath(int(file_id))
        local = self._ready(int(file_id), rel)
        if local is not None:
            self._count(1, 0)
            return local
        self._count(0, 1)
        return Path(self.root) / rel

    def piece(self, shard: int, sample: int, offset: int) -> Path | None:
        """The staged piece of `sample` (its bytes at `offset` of `shard`, hpcdl.staging.pieces)
        when the stager has it READY, else None (the caller reads the shard; counted there)."""
        slot = len(self._files) + int(sample)
        local = self._ready(slot, piece_relpath(self.relpath(int(shard)), offset))
        if local is not None:
            self._count(1, 0)
        return local

    def _ready(self, slot: int, rel: str) -> Path | None:
        """The local copy of status slot `slot` at rel when READY and present, else None."""
        if self._status is None:
            files = SessionDir(Path(self.meta))
            self._status = StatusView(files.status, self.layout)
            self._counters = CounterFile(files.counters, self.ranks)
        if self._status.state(slot) != self.layout.file_states["READY"]:
            return None
        local = os.path.join(self.local_root, rel)
        try:
            return Path(local) if stat.S_ISREG(os.lstat(local).st_mode) else None
        except OSError:
            return None  # evicted meanwhile

    def _count(self, hits: int, misses: int) -> None:
        try:
            self._counters.add(self.local_rank, hits, misses)
        except OSError:
            pass  # counters gone (session closed, or staging never started): reads still work


@dataclass(frozen=True)
class StartInfo:
    """What local rank 0 tells its node's ranks (one bcast) once it tried to start the stager."""

    error: str | None = None  # a start-up error: every rank stops with it (_agree)
    stage_dir: str = ""  # the stage dir, resolved (empty with an error)
    ok: bool = False  # the stager reported RUNNING
    why: str = ""  # why not, when not ok: one warning, then training reads from the PFS
    key: str = ""  # the data set's tree in the stage dir (data_key); empty: no lease taken
    meta: str = ""  # this job's session dir; empty: no lease taken
    steps: int = 0  # steps per epoch of the plan written; 0: no plan written
    fingerprint: str = ""  # the data set's fingerprint in that plan


@dataclass(frozen=True)
class NodeRanks:
    """Where this rank sits on its node (a single process: alone on node 0)."""

    comm: Any  # the node's communicator (SoloComm alone)
    local_rank: int = 0
    local_size: int = 1
    node: int = 0  # the node's index
    ranks: tuple[int, ...] = (0,)  # the world ranks on the node, in local-rank order
    world_rank: int = 0

    @classmethod
    def of(cls, world: Any) -> NodeRanks:
        """The ranks of world (hpcdl.comm.world.World, or None for a single process)."""
        if world is None:
            return cls(SoloComm())
        comm = world.node_comm or SoloComm()
        return cls(comm, world.local_rank, world.local_size, world.node_index,
                   tuple(world.node_ranks), world.rank)  # fmt: skip


@dataclass(frozen=True)
class SessionFiles:
    """The session as every local rank reaches it once started: its paths and shared maps
    (meta, local_root and the maps are None where no lease was taken or no plan written)."""

    stage_dir: Path = Path()  # resolved
    meta: Path | None = None  # this job's session dir (plan, status, progress, counters)
    local_root: Path | None = None  # the data set's tree in the stage dir
    status: StatusView | None = None
    progress: ProgressFile | None = None
    counters: CounterFile | None = None

    @classmethod
    def attach(cls, info: StartInfo, local_size: int) -> SessionFiles:
        """Open what local rank 0 made (info), or note that staging is off."""
        stage_dir = Path(info.stage_dir)
        if not info.meta:
            return cls(stage_dir)
        meta = Path(info.meta)
        if not info.steps:
            return cls(stage_dir, meta, stage_dir / info.key)
        files = SessionDir(meta)
        return cls(stage_dir, meta, stage_dir / info.key, StatusView(files.status),
                   ProgressFile(files.progress, local_size),
                   CounterFile(files.counters, local_size))  # fmt: skip

    def field(self, name: str) -> int:
        """A status map field; 0 without a map."""
        return int(self.status.field(name)) if self.status is not None else 0

    def totals(self, local_rank: int) -> tuple[int, int]:
        """(hits, misses) of a local rank's processes; (0, 0) without counters."""
        return self.counters.totals(local_rank) if self.counters is not None else (0, 0)

    def close(self) -> None:
        for mapped in (self.status, self.progress, self.counters):
            if mapped is not None:
                mapped.close()


class Leaving:
    """Leaving the stage dir once: close (every local rank) and abandon (one rank, any thread,
    a failing job's stand-down) may race; the first runs its steps under the lock, so the
    other returns only once they are done."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.done = False

    def once(self, steps: Callable[[], None]) -> bool:
        """Run steps unless already left; False if already left."""
        with self._lock:
            if self.done:
                return False
            self.done = True
            steps()
            return True


class SaidOnce:
    """What a session says at most once: a key's first `first(key)` is True, later ones False."""

    def __init__(self) -> None:
        self._said: set[str] = set()

    def first(self, key: str) -> bool:
        if key in self._said:
            return False
        self._said.add(key)
        return True


class StagingSession:
    """One node's staging for one training run; see StagingSession.start.

    Its parts: where this rank sits on its node (ranks), the plan its stager holds (plan), the
    stage dir's lease (local rank 0), the stager (launched by local rank 0, watched by every
    rank), the session's paths and shared maps (files), what was said once, and leaving.
    """

    def __init__(self, world: Any, plan: RollingPlan, keep: bool):
        self.world = world
        self.ranks = NodeRanks.of(world)
        self.plan = plan
        self.keep = keep  # leave the copies (and the status map) at close
        self.lease: StageDirLease | None = None  # local rank 0 with staging on
        self.peer_tier: PeerTier | None = None  # local rank 0 of a node in the peer tier
        self.stager = StagerProcess()
        self.files = SessionFiles()  # set by start, on every local rank
        self.said = SaidOnce()  # PFS_FALLBACK, OUTRAN_CHECK
        self.leaving = Leaving()
        self._last_sample = {"copies": 0, "pfs_fallbacks": 0}  # counter_sample's, once closed

    @classmethod
    def start(
        cls,
        world: Any,
        dataset: Any,
        sampler: SamplerSpec,
        batch_size: int,
        epochs: tuple[int, int] | int,
        options: StageOptions,
    ) -> StagingSession:
        """Plan the node's files, start the stager on local rank 0, return on every local rank.

        world: hpcdl.comm.world.World, or None for a single process. sampler: the job's
        SamplerSpec. epochs: (start_epoch, end_epoch) of the run, or an end epoch; the stager
        holds a plan for the current and the next epoch and gets a new one at each epoch change.
        options: the stage dir and how to stage into it (StageOptions).
        A stage dir that overlaps the data, cannot be created or written, or a missing
        hpcdl-stage stops every rank with one message (SystemExitWithMessage under MPI,
        StageDirError alone). A full stage file system, or a stager that fails to start, only
        warns, and training reads from the PFS.
        """
        begin, end = (0, int(epochs)) if isinstance(epochs, int) else map(int, epochs)
        ranks = NodeRanks.of(world)
        plan = RollingPlan(dataset, sampler, batch_size, (begin, end), ranks.node, ranks.ranks)
        session = cls(world, plan, options.keep)
        error = None
        try:
            check_no_overlap(options.stage_dir, options.protect or {"--data": dataset.root})
        except StageDirError as exc:
            error = str(exc)
        session._start_peer_tier(options)
        session._use_pieces(options)
        info = StartInfo(error=error)
        if ranks.local_rank == 0 and error is None:
            info = session._prepare(options)
        if session.peer_tier is not None and not info.ok:
            session.peer_tier.close_listener()  # no stager serves here: peers are refused at once
        info = ranks.comm.bcast(info, root=0)
        _agree(world, info.error)
        session._attach(info)
        return session

    @property
    def meta(self) -> Path | None:
        """This job's session dir (None where staging is off): for callers that inspect it."""
        return self.files.meta

    @property
    def local_root(self) -> Path | None:
        """The data set's tree in the stage dir (None where staging is off)."""
        return self.files.local_root

    @property
    def status(self) -> StatusView | None:
        """The session's status map (None where staging is off)."""
        return self.files.status

    # ------------------------------------------------------------------ trainer API

    def locator(self) -> Locator:
        """Picklable file_id -> Path for the loader (and its worker processes)."""
        files, ranks = self.files, self.ranks
        dataset = self.plan.dataset
        return Locator(files.local_root, files.meta, Path(dataset.root), dataset.files,
                       ranks.local_rank, ranks.local_size)  # fmt: skip

    def consumed(self, epoch: int, step: int) -> None:
        """This rank has finished reading steps [0, step) of epoch."""
        plan, progress = self.plan, self.files.progress
        if progress is None:
            return
        progress.set(self.ranks.local_rank, plan.position(epoch, step))
        if epoch == plan.begin and step >= plan.steps_per_epoch and self.said.first(OUTRAN_CHECK):
            self._check_first_epoch()
        if self.ranks.local_rank == 0 and plan.due(epoch):
            self._replan(epoch)
        self._check_alive(CHECK_EVERY_S)

    def progress_record(self) -> dict[str, int] | None:
        """Node view for hpcdl.report (local rank 0; None elsewhere): files of the current plan
        staged (READY) vs files the slowest local rank has already needed."""
        plan, files = self.plan, self.files
        if plan.first_use is None or files.progress is None:
            return None
        done = min(files.progress.get(r) for r in range(self.ranks.local_size))
        return {
            "files_ready": files.field("plan_ready"),
            "consumed_files": plan.files_needed(done),
            "plan_files": len(plan.first_use),
        }

    def counter_sample(self) -> dict[str, int]:
        """The node's cumulative files staged and PFS fallbacks (misses, every local rank):
        what --timeline draws per node as rates (hpcdl.diag; local rank 0, any thread). Once
        closed, the last values read."""
        if not self.leaving.done:
            files = self.files
            misses = sum(files.totals(r)[1] for r in range(self.ranks.local_size))
            self._last_sample = {"copies": files.field("files_staged"), "pfs_fallbacks": misses}
        return self._last_sample

    def epoch_stats(self) -> dict[str, Any]:
        """Cumulative since start: node's files/bytes staged, this rank's hits/misses, liveness,
        and the node stager's PFS opens and peer counters (PEER_COUNTERS)."""
        hits, misses = self.files.totals(self.ranks.local_rank)
        self._check_alive()
        field = self.files.field
        return {
            "files_staged": field("files_staged") + field("files_reused"),
            "bytes_staged": field("bytes_staged") + field("bytes_reused"),
            "hits": int(hits),
            "misses": int(misses),
            "stager_alive": self.stager.running,
            # The node's stager: its PFS opens and the peer tier's share (docs/staging.md).
            **{name: field(name) for name in PEER_COUNTERS},
        }

    def close(self) -> None:
        """Every local rank together: stop the stager (local rank 0) and leave the stage dir;
        the last job out removes what hpcdl created there unless keep. Idempotent."""
        if self.leaving.done:
            return
        self.ranks.comm.Barrier()  # every local rank has finished reading
        if self.leaving.once(lambda: self._leave(signal.SIGUSR1)):
            self.files.close()
        self.ranks.comm.Barrier()

    def abandon(self) -> None:
        """This rank alone, when the job fails: as close, without a collective and leaving the
        shared maps mapped (another thread may still read them; the process ends soon).
        Thread-safe and idempotent; a failing job's stand-down clean-up (hpcdl.comm.failure)."""
        self.leaving.once(lambda: self._leave(signal.SIGTERM))

    def _leave(self, stop_signal: int) -> None:
        """Stop the stager and release the stage dir (once: Leaving).

        stop_signal: SIGUSR1 tells the stager that the job ended (its last line says it
        finished), SIGTERM that it is stopped (a failing job)."""
        self.stager.stop(stop_signal)
        if self.peer_tier is not None:  # the port is free only once no stager serves it
            self.peer_tier.close_listener()
        if self.lease is not None:
            self.lease.release(self.keep)

    # ------------------------------------------------------------------ internals

    def _start_peer_tier(self, options: StageOptions) -> None:
        """Every rank, when the peer tier runs: the collective start (PeerTier.start)."""
        world, plan = self.world, self.plan
        shuffle = plan.sampler.shuffle
        if world is None or not peer_tier_wanted(options.peers, world.num_nodes, shuffle):
            return
        capacity = 0
        if world.is_node_leader:
            try:
                capacity = parse_capacity(options.capacity, options.stage_dir)
                if capacity is None:
                    capacity = default_capacity(options.stage_dir)
            except (ValueError, OSError, subprocess.CalledProcessError, StagerNotFound):
                capacity = 0  # no home here; the stage dir's own error comes next
        epochs = (plan.begin, plan.end)
        self.peer_tier, error = PeerTier.start(
            world, plan.dataset, plan.sampler, plan.batch_size, epochs, capacity, options.peers
        )
        _agree(world, error)

    def _use_pieces(self, options: StageOptions) -> None:
        """Every rank: a run whose peer tier may fetch pieces of tar shards plans every status
        slot (hpcdl.staging.pieces); its node leaders split the shards homed elsewhere."""
        world, plan = self.world, self.plan
        wanted = world is not None and peer_tier_wanted(
            options.peers, world.num_nodes, plan.sampler.shuffle
        )
        if not (wanted and pieces_possible(plan.dataset, options.ranges)):
            return
        plan.slots = PieceSlots(plan.dataset)
        if self.peer_tier is not None:
            plan.split = self.peer_tier.splitter(plan.slots, options.ranges, self.ranks.node)

    def _peer_lines(self, plan: Any) -> list[str]:
        return self.peer_tier.plan_lines(plan) if self.peer_tier is not None else []

    def _prepare(self, options: StageOptions) -> StartInfo:
        """Local rank 0: lease the stage dir, write the plan, start the stager."""
        stage_dir = Path(options.stage_dir)
        try:
            binary = find_stager_binary()
            status_layout()  # also: the binary is this hpcdl's stager (cached for the session)
            self.lease = lease = StageDirLease.acquire(stage_dir)
        except (StageDirError, StagerNotFound) as exc:
            return StartInfo(error=str(exc))
        except StageDirFull as exc:
            return StartInfo(why=str(exc), stage_dir=str(stage_dir))
        meta, files, key = lease.meta, lease.files, data_key(self.plan.dataset.root)
        info = StartInfo(stage_dir=str(lease.stage_dir), key=key, meta=str(meta))
        try:
            self.plan.fingerprint = dataset_fingerprint(self.plan.dataset)
            plan = self.plan.make(self.plan.begin)
            peer_lines = self._peer_lines(plan)
            self.plan.write(files.plan, plan, key, peer_lines)
            ProgressFile.create(files.progress, self.ranks.local_size)
            CounterFile.create(files.counters, self.ranks.local_size)
            cap = parse_capacity(options.capacity, lease.stage_dir)
        except OSError as exc:
            return replace(info, why=f"cannot write its plan in {meta}: {exc.strerror or exc}")
        threads, verify = options.threads, options.verify
        tier = self.peer_tier if peer_lines or self._serves() else None
        self.stager = StagerProcess.launch(binary, lease.stage_dir, lease.session, threads, cap,
                                           verify, tier, nice=options.nice,
                                           cores=options.cores)  # fmt: skip
        ok, why = self.stager.wait_running(files.status)
        return replace(
            info, ok=ok, why=why, steps=plan.steps_per_epoch, fingerprint=self.plan.fingerprint
        )

    def _serves(self) -> bool:
        return self.peer_tier is not None and self.peer_tier.listener is not None

    def _attach(self, info: StartInfo) -> None:
        """Every local rank: open the session's shared files, or note that staging is off."""
        self.files = SessionFiles.attach(info, self.ranks.local_size)
        if info.steps:
            self.plan.steps_per_epoch, self.plan.fingerprint = info.steps, info.fingerprint
        self.stager.watch(self.files.status, info.ok)
        if not info.ok:
            self._warn(f"the staging process did not start ({info.why})")

    def _replan(self, epoch: int) -> None:
        plan = self.plan.make(epoch)
        key = self.files.local_root.name
        self.plan.write(SessionDir(self.files.meta).plan, plan, key, self._peer_lines(plan))

    def _check_first_epoch(self) -> None:
        """Once per job (world rank 0, for its node): warn when the first epoch outran staging
        (hpcdl.staging.outran)."""
        if self.ranks.world_rank != 0:
            return
        self._check_alive()  # a stager that died explains the misses: its own warning says so
        need, files = self.plan.first_epoch_need, self.files
        if not self.stager.running or need is None or files.counters is None:
            return
        seconds = time.monotonic() - self.stager.since
        text = outran_warning(
            self.ranks.node, need, files.status, files.counters, self.ranks.local_size, seconds
        )
        if text is not None:
            warnings.warn(text, RuntimeWarning, stacklevel=3)

    def _check_alive(self, min_interval_s: float = 0.0) -> None:
        # A stager that ended on a signal (the job's stop reaches it too) said so in its own
        # last line; only one that died or hangs needs hpcdl's warning.
        if self.stager.lost(min_interval_s) and not self.stager.ended_on_its_own():
            self._warn("the staging process stopped")

    def _warn(self, what: str) -> None:
        if self.ranks.local_rank == 0 and self.said.first(PFS_FALLBACK):
            warnings.warn(
                f"hpcdl staging on node {self.ranks.node}: {what}; files not yet staged in "
                f"{self.files.stage_dir} are read from the parallel file system",
                RuntimeWarning,
                stacklevel=3,
            )


def _agree(world: Any, error: str | None) -> None:
    """Stop every rank when any rank has a start-up error; the message is printed once."""
    if world is None:
        if error is not None:
            raise StageDirError(error)
        return
    agree_on_errors(world.comm, world.rank, error)
