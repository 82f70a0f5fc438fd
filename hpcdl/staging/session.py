"""StagingSession: the trainer's handle on the node's staging process.

Local rank 0 of each node leases the stage dir (hpcdl.staging.ownership), writes the plan into
its session dir, starts `hpcdl-stage` and stops it at the end; every local rank publishes its
consumption cursor and asks the status map where each file is. A dead stager is noticed through
its heartbeat: one warning, then every file not already staged is read from the PFS. Nothing
here blocks on the stager.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import subprocess
import threading
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from hpcdl.comm.failure import agree_on_errors
from hpcdl.comm.world import SoloComm
from hpcdl.config import STAGE_NICE, STAGE_THREADS
from hpcdl.data.dataset import FileTable
from hpcdl.data.sampler import SamplerSpec
from hpcdl.paths import nearest_existing
from hpcdl.staging.binary import StagerNotFound, find_stager_binary
from hpcdl.staging.layout import SessionDir
from hpcdl.staging.ownership import (
    StageDirError,
    StageDirFull,
    StageDirLease,
    check_no_overlap,
    data_key,
)
from hpcdl.staging.peer_tier import PeerTier, peer_tier_wanted
from hpcdl.staging.plan import dataset_fingerprint, plan_for_node, write_plan
from hpcdl.staging.stager_process import CHECK_EVERY_S, StagerProcess
from hpcdl.staging.status import CounterFile, ProgressFile, StatusView, status_layout

PEER_COUNTERS = ("pfs_opens", "peer_files", "peer_bytes", "peer_fallbacks", "files_served")
PLAN_EPOCHS = 2  # the stager always holds a plan for the current and the next epoch
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_capacity(value: str | int | None, stage_dir: str | Path) -> int | None:
    """Bytes staging may use: int, '200G' (binary units), '80%' of free space; 0 stages nothing.

    None (or '') stays None: hpcdl-stage then uses its default (default_capacity()).
    """
    if value is None or value == "":
        return None
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?)(i?B?)?\s*(%?)\s*", str(value))
    if not m or (m.group(4) and m.group(2)):
        raise ValueError(
            f"stage capacity must be bytes (e.g. 200G) or a percentage (e.g. 80%), got {value!r}"
        )
    number = float(m.group(1))
    if m.group(4):
        if number > 100:
            raise ValueError(f"stage capacity {value!r}: a percentage must be at most 100%")
        free = shutil.disk_usage(nearest_existing(stage_dir)).free
        return int(free * number / 100)
    return int(number * _UNITS[m.group(2)])


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
    set root). keep: leave the copies (and the status map) at close.
    """

    stage_dir: str | Path
    threads: int = STAGE_THREADS
    nice: str = STAGE_NICE  # "auto" or "0".."19" (nice_flags)
    capacity: str | int | None = None
    keep: bool = False
    verify: bool = False
    protect: dict[str, Any] | None = field(default=None, hash=False)
    peers: str = "auto"  # --peer-staging: auto, on, off (hpcdl.staging.peer_tier)


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
        if self._status is None:
            files = SessionDir(Path(self.meta))
            self._status = StatusView(files.status, self.layout)
            self._counters = CounterFile(files.counters, self.ranks)
        rel = self.relpath(int(file_id))
        if self._status.state(int(file_id)) == self.layout.file_states["READY"]:
            local = os.path.join(self.local_root, rel)
            try:
                if stat.S_ISREG(os.lstat(local).st_mode):
                    self._count(1, 0)
                    return Path(local)
            except OSError:
                pass  # evicted meanwhile
        self._count(0, 1)
        return Path(self.root) / rel

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


class StagingSession:
    """One node's staging for one training run; see StagingSession.start."""

    def __init__(
        self,
        world: Any,
        dataset: Any,
        sampler: SamplerSpec,
        batch_size: int,
        epochs: tuple[int, int],
        lease: StageDirLease | None,
        keep: bool,
    ):
        self.world = world
        self.node_comm = world.node_comm if world is not None and world.node_comm else SoloComm()
        self.local_rank = world.local_rank if world is not None else 0
        self.local_size = world.local_size if world is not None else 1
        self.node = world.node_index if world is not None else 0
        self.node_ranks = world.node_ranks if world is not None else (0,)  # world ranks here
        self.dataset = dataset
        self.sampler = sampler  # every rank's reading order
        self.batch_size = batch_size
        self.begin, self.end = epochs  # epochs [begin, end) of this run
        self.plan_begin = self.begin  # first epoch of the plan the stager holds
        self.lease = lease  # None on other local ranks than 0, and when staging is off
        self.keep = keep  # leave the copies (and the status map) at close
        self.stage_dir: Path | None = None  # resolved; set by _attach
        self.meta: Path | None = None  # this job's session dir (plan, status, progress, counters)
        self.local_root: Path | None = None  # the data set's tree in the stage dir
        self.stager = StagerProcess()  # launched by local rank 0; watched by every rank
        self.steps_per_epoch = 0
        self.fingerprint = ""
        self.first_use: np.ndarray | None = None  # (F,) first step of each plan entry (rank 0)
        self.status: StatusView | None = None
        self.progress: ProgressFile | None = None
        self.counters: CounterFile | None = None
        self.first_epoch_need: tuple[int, int] | None = None  # (files, bytes) of epoch begin
        self.started = 0.0  # monotonic time the stager reported RUNNING
        self.outran_checked = False  # the first epoch was compared with staging (rank 0)
        self.warned = False  # the one "reading from the PFS" warning was given
        self.closed = False
        self._last_sample = {"copies": 0, "pfs_fallbacks": 0}  # counter_sample's, once closed
        self.peer_tier: PeerTier | None = None  # local rank 0 of a node in the peer tier
        self._leaving = threading.Lock()  # close/abandon may race with a stand-down clean-up

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
        session = cls(world, dataset, sampler, batch_size, (begin, end), None, options.keep)
        error = None
        try:
            check_no_overlap(options.stage_dir, options.protect or {"--data": dataset.root})
        except StageDirError as exc:
            error = str(exc)
        session._start_peer_tier(options)
        info = StartInfo(error=error)
        if session.local_rank == 0 and error is None:
            info = session._prepare(options)
        if session.peer_tier is not None and not info.ok:
            session.peer_tier.close_listener()  # no stager serves here: peers are refused at once
        info = session.node_comm.bcast(info, root=0)
        _agree(world, info.error)
        session._attach(info)
        return session

    # ------------------------------------------------------------------ trainer API

    def locator(self) -> Locator:
        """Picklable file_id -> Path for the loader (and its worker processes)."""
        return Locator(
            self.local_root,
            self.meta,
            Path(self.dataset.root),
            self.dataset.files,
            self.local_rank,
            self.local_size,
        )

    def consumed(self, epoch: int, step: int) -> None:
        """This rank has finished reading steps [0, step) of epoch."""
        if self.progress is None:
            return
        self.progress.set(self.local_rank, epoch * self.steps_per_epoch + step)
        if not self.outran_checked and epoch == self.begin and step >= self.steps_per_epoch:
            self._check_first_epoch()
        if self.local_rank == 0 and epoch > self.plan_begin and epoch + 1 < self.end:
            self._replan(epoch)
        self._check_alive(CHECK_EVERY_S)

    def progress_record(self) -> dict[str, int] | None:
        """Node view for hpcdl.report (local rank 0; None elsewhere): files of the current plan
        staged (READY) vs files the slowest local rank has already needed."""
        if self.first_use is None or self.progress is None:
            return None
        done = min(self.progress.get(r) for r in range(self.local_size))
        cursor = done - self.plan_begin * self.steps_per_epoch
        return {
            "files_ready": int(self.status.field("plan_ready")),
            "consumed_files": int(np.searchsorted(self.first_use, cursor, side="left")),
            "plan_files": len(self.first_use),
        }

    def counter_sample(self) -> dict[str, int]:
        """The node's cumulative files staged and PFS fallbacks (misses, every local rank):
        what --timeline draws per node as rates (hpcdl.diag; local rank 0, any thread). Once
        closed, the last values read."""
        if not self.closed:
            field = self.status.field if self.status else (lambda name: 0)
            misses = sum(self.counters.totals(r)[1] for r in range(self.local_size)) if (
                self.counters) else 0  # fmt: skip
            self._last_sample = {"copies": int(field("files_staged")), "pfs_fallbacks": misses}
        return self._last_sample

    def epoch_stats(self) -> dict[str, Any]:
        """Cumulative since start: node's files/bytes staged, this rank's hits/misses, liveness,
        and the node stager's PFS opens and peer counters (PEER_COUNTERS)."""
        hits, misses = self.counters.totals(self.local_rank) if self.counters else (0, 0)
        self._check_alive()
        field = self.status.field if self.status else (lambda name: 0)
        return {
            "files_staged": int(field("files_staged") + field("files_reused")),
            "bytes_staged": int(field("bytes_staged") + field("bytes_reused")),
            "hits": int(hits),
            "misses": int(misses),
            "stager_alive": self.stager.running,
            # The node's stager: its PFS opens and the peer tier's share (docs/staging.md).
            **{name: int(field(name)) for name in PEER_COUNTERS},
        }

    def close(self) -> None:
        """Every local rank together: stop the stager (local rank 0) and leave the stage dir;
        the last job out removes what hpcdl created there unless keep. Idempotent."""
        if self.closed:
            return
        self.node_comm.Barrier()  # every local rank has finished reading
        if self._leave(signal.SIGUSR1):
            for mapped in (self.status, self.progress, self.counters):
                if mapped is not None:
                    mapped.close()
        self.node_comm.Barrier()

    def abandon(self) -> None:
        """This rank alone, when the job fails: as close, without a collective and leaving the
        shared maps mapped (another thread may still read them; the process ends soon).
        Thread-safe and idempotent; a failing job's stand-down clean-up (hpcdl.comm.failure)."""
        self._leave(signal.SIGTERM)

    def _leave(self, stop_signal: int) -> bool:
        """Stop the stager and release the stage dir, once; False if already done.

        stop_signal: SIGUSR1 tells the stager that the job ended (its last line says it
        finished), SIGTERM that it is stopped (a failing job)."""
        with self._leaving:
            if self.closed:
                return False
            self.closed = True
            self.stager.stop(stop_signal)
            if self.peer_tier is not None:  # the port is free only once no stager serves it
                self.peer_tier.close_listener()
            if self.lease is not None:
                self.lease.release(self.keep)
            return True

    # ------------------------------------------------------------------ internals

    def _start_peer_tier(self, options: StageOptions) -> None:
        """Every rank, when the peer tier runs: the collective start (PeerTier.start)."""
        world = self.world
        if world is None or not peer_tier_wanted(
            options.peers, world.num_nodes, self.sampler.shuffle
        ):
            return
        capacity = 0
        if world.is_node_leader:
            try:
                capacity = parse_capacity(options.capacity, options.stage_dir)
                if capacity is None:
                    capacity = default_capacity(options.stage_dir)
            except (ValueError, OSError, subprocess.CalledProcessError, StagerNotFound):
                capacity = 0  # no home here; the stage dir's own error comes next
        epochs = (self.begin, self.end)
        self.peer_tier, error = PeerTier.start(
            world, self.dataset, self.sampler, self.batch_size, epochs, capacity, options.peers
        )
        _agree(world, error)

    def _peer_lines(self, plan: Any) -> list[str]:
        return self.peer_tier.plan_lines(plan) if self.peer_tier is not None else []

    def _prepare(self, options: StageOptions) -> StartInfo:
        """Local rank 0: lease the stage dir, write the plan, start the stager."""
        stage_dir = Path(options.stage_dir)
        try:
            binary = find_stager_binary()
            status_layout()  # also: the binary is this hpcdl's stager (cached for the session)
            self.lease = StageDirLease.acquire(stage_dir)
        except (StageDirError, StagerNotFound) as exc:
            return StartInfo(error=str(exc))
        except StageDirFull as exc:
            return StartInfo(why=str(exc), stage_dir=str(stage_dir))
        meta, files, key = self.lease.meta, self.lease.files, data_key(self.dataset.root)
        info = StartInfo(stage_dir=str(self.lease.stage_dir), key=key, meta=str(meta))
        try:
            self.fingerprint = dataset_fingerprint(self.dataset)
            plan = self._plan(self.begin)
            peer_lines = self._peer_lines(plan)
            write_plan(files.plan, plan, self.dataset, self.fingerprint, key, peer_lines)
            ProgressFile.create(files.progress, self.local_size)
            CounterFile.create(files.counters, self.local_size)
            cap = parse_capacity(options.capacity, self.lease.stage_dir)
        except OSError as exc:
            return replace(info, why=f"cannot write its plan in {meta}: {exc.strerror or exc}")
        lease, threads, verify = self.lease, options.threads, options.verify
        tier = self.peer_tier if peer_lines or self._serves() else None
        self.stager = StagerProcess.launch(binary, lease.stage_dir, lease.session, threads, cap,
                                           verify, tier, nice=options.nice)  # fmt: skip
        ok, why = self.stager.wait_running(files.status)
        return replace(
            info, ok=ok, why=why, steps=plan.steps_per_epoch, fingerprint=self.fingerprint
        )

    def _serves(self) -> bool:
        return self.peer_tier is not None and self.peer_tier.listener is not None

    def _attach(self, info: StartInfo) -> None:
        """Every local rank: open the session's shared files, or note that staging is off."""
        self.stage_dir = Path(info.stage_dir)
        if info.meta:
            self.meta = Path(info.meta)
            self.local_root = self.stage_dir / info.key
        if info.steps:
            self.steps_per_epoch = info.steps
            self.fingerprint = info.fingerprint
            files = SessionDir(self.meta)
            self.status = StatusView(files.status)
            self.progress = ProgressFile(files.progress, self.local_size)
            self.counters = CounterFile(files.counters, self.local_size)
        self.stager.watch(self.status, info.ok)
        self.started = time.monotonic()
        if not info.ok:
            self._warn(f"the staging process did not start ({info.why})")

    def _plan(self, epoch: int) -> Any:
        plan = plan_for_node(
            self.dataset,
            self.sampler,
            self.batch_size,
            (epoch, min(epoch + PLAN_EPOCHS, self.end)),
            ranks=self.node_ranks,
            node=self.node,
        )
        self.first_use = plan.first_use()
        if epoch == self.begin:
            first = self.first_use < plan.steps_per_epoch
            self.first_epoch_need = (int(first.sum()), int(plan.sizes[first].sum()))
        return plan

    def _replan(self, epoch: int) -> None:
        self.plan_begin = epoch
        plan = self._plan(epoch)
        key = self.local_root.name
        plan_path = SessionDir(self.meta).plan
        write_plan(plan_path, plan, self.dataset, self.fingerprint, key, self._peer_lines(plan))

    def _check_first_epoch(self) -> None:
        """Once per job (world rank 0, for its node): when readers went to the PFS in the first
        epoch because copies were not ready yet, say what rate staging would have needed."""
        self.outran_checked = True
        rank = self.world.rank if self.world is not None else 0
        if rank == 0:
            self._check_alive()  # a stager that died explains the misses: its own warning says so
        if (
            rank != 0
            or not self.stager.running
            or self.first_epoch_need is None
            or self.counters is None
        ):
            return
        misses = sum(self.counters.totals(r)[1] for r in range(self.local_size))
        reads = misses + sum(self.counters.totals(r)[0] for r in range(self.local_size))
        files, nbytes = self.first_epoch_need
        status = self.status
        if misses == 0 or status.has_flag("NOSPACE") or status.has_flag("CAPACITY_FULL"):
            return  # all staged in time, or the capacity's own message explains the misses
        if status.field("capacity") < nbytes or status.field("failures"):
            return  # the capacity line or the stager's failure lines explain them
        seconds = max(time.monotonic() - self.started, 1e-3)
        warnings.warn(
            f"hpcdl staging on node {self.node}: the first epoch outran staging: {misses} of "
            f"{reads} reads went to the parallel file system because their copies were not "
            f"ready; staging copied {status.field('files_staged') / seconds:.1f} files/s "
            f"({status.field('bytes_staged') / 1e6 / seconds:.2f} MB/s), keeping up needed "
            f"{files / seconds:.1f} files/s ({nbytes / 1e6 / seconds:.2f} MB/s) over "
            f"{seconds:.2f} s; raise --stage-threads, or stage before training with a "
            "stage-only step (python -m hpcdl.stage)",
            RuntimeWarning,
            stacklevel=3,
        )

    def _check_alive(self, min_interval_s: float = 0.0) -> None:
        if self.stager.lost(min_interval_s):
            self._warn("the staging process stopped")

    def _warn(self, what: str) -> None:
        if not self.warned and self.local_rank == 0:
            self.warned = True
            warnings.warn(
                f"hpcdl staging on node {self.node}: {what}; files not yet staged in "
                f"{self.stage_dir} are read from the parallel file system",
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
