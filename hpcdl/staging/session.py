"""StagingSession: the trainer's handle on the node's staging process.

Local rank 0 of each node writes the plan, starts `hpcdl-stage` and stops it at the end; every
local rank publishes its consumption cursor and asks the status map where each file is. A dead
stager is noticed through its heartbeat: one warning, then every file not already staged is read
from the PFS. Nothing here blocks on the stager.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hpcdl.staging.binary import find_stager_binary
from hpcdl.staging.plan import dataset_fingerprint, plan_for_node, write_plan
from hpcdl.staging.status import (
    READY,
    RUN_RUNNING,
    CounterFile,
    ProgressFile,
    StatusView,
    stager_alive,
)

PLAN_EPOCHS = 2  # the stager always holds a plan for the current and the next epoch
START_TIMEOUT_S = 30.0
HEARTBEAT_TIMEOUT_S = 5.0
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_capacity(value: str | int | None, stage_dir: str | Path) -> int:
    """Bytes staging may use: int, '200G' (binary units), '80%' of free space, None = default.

    The default is the free space of the stage dir's file system minus max(5 %, 1 GiB).
    """
    usage = shutil.disk_usage(_existing_parent(Path(stage_dir)))
    if value is None or value == "":
        margin = max(usage.total // 20, 2**30)
        return max(usage.free - margin, 0)
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
        return int(usage.free * number / 100)
    return int(number * _UNITS[m.group(2)])


def _existing_parent(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def make_stage_dir(stage_dir: Path) -> bool:
    """Create stage_dir (and .hpcdl) with mode 0700; True when stage_dir was created here."""
    created = not stage_dir.exists()
    stage_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    if stage_dir.stat().st_uid == os.getuid():
        os.chmod(stage_dir, 0o700)
    meta = stage_dir / ".hpcdl"
    if meta.is_symlink():
        raise RuntimeError(f"{meta} is a symlink; refusing to stage through it")
    meta.mkdir(mode=0o700, exist_ok=True)
    return created


class Locator:
    """Picklable `file_id -> Path`: the local copy when READY and present, else the PFS path.

    Counts hits and misses per process in the shared counters file, so loader worker processes
    are counted too.
    """

    def __init__(
        self, stage_dir: Path, root: Path, relpaths: list[str], local_rank: int, ranks: int
    ):
        self.stage_dir = str(stage_dir)
        self.root = str(root)
        self._names = "\n".join(relpaths).encode()
        ends = np.cumsum([len(r.encode()) + 1 for r in relpaths], dtype=np.int64)
        self._starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
        self._ends = ends - 1
        self.local_rank = local_rank
        self.ranks = ranks
        self._status: StatusView | None = None
        self._counters: CounterFile | None = None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_status"] = state["_counters"] = None
        return state

    def relpath(self, file_id: int) -> str:
        return self._names[self._starts[file_id] : self._ends[file_id]].decode()

    def __call__(self, file_id: int) -> Path:
        if self._status is None:
            self._status = StatusView(os.path.join(self.stage_dir, ".hpcdl", "status"))
            self._counters = CounterFile(
                os.path.join(self.stage_dir, ".hpcdl", "counters"), self.ranks
            )
        rel = self.relpath(int(file_id))
        if self._status.state(int(file_id)) == READY:
            local = os.path.join(self.stage_dir, rel)
            if os.path.isfile(local):
                self._count(1, 0)
                return Path(local)
        self._count(0, 1)
        return Path(self.root) / rel

    def _count(self, hits: int, misses: int) -> None:
        try:
            self._counters.add(self.local_rank, hits, misses)
        except OSError:
            pass  # counters gone (session closed): reads still work


class _Solo:
    """Stand-in for world.node_comm in a single-process session."""

    def bcast(self, obj: Any, root: int = 0) -> Any:
        return obj

    def Barrier(self) -> None:  # noqa: N802 (mpi4py spelling)
        pass


@dataclass
class _Layout:
    stage_dir: Path
    meta: Path
    created: bool


class StagingSession:
    """One node's staging for one training run; see StagingSession.start."""

    def __init__(self, **kw: Any):
        self.__dict__.update(kw)

    @classmethod
    def start(
        cls,
        world: Any,
        dataset: Any,
        sampler_args: dict,
        batch_size: int,
        epochs: tuple[int, int] | int,
        stage_dir: str | Path,
        threads: int = 8,
        capacity: str | int | None = None,
        keep: bool = False,
        verify: bool = False,
    ) -> StagingSession:
        """Plan the node's files, start the stager on local rank 0, return on every local rank.

        world: hpcdl.comm.world.World, or None for a single process. sampler_args:
        DistributedSampler fields except rank. epochs: (start_epoch, end_epoch) of the run, or an
        end epoch; the stager holds a plan for the current and the next epoch and gets a new one
        at each epoch change. capacity: bytes, '200G', '80%' or None (free space minus a margin).
        Raises RuntimeError on every local rank when hpcdl-stage is not installed; a stager that
        fails to start only warns, and training reads from the PFS.
        """
        node_comm = (
            world.node_comm if world is not None and world.node_comm is not None else _Solo()
        )
        local_rank = world.local_rank if world is not None else 0
        local_size = world.local_size if world is not None else 1
        node = world.node_index if world is not None else 0
        begin, end = (0, int(epochs)) if isinstance(epochs, int) else map(int, epochs)
        stage_dir = Path(stage_dir).absolute()
        meta = stage_dir / ".hpcdl"
        info: dict[str, Any] = {}
        proc, first_use = None, None
        if local_rank == 0:
            try:
                binary = find_stager_binary()
                created = make_stage_dir(stage_dir)
                fingerprint = dataset_fingerprint(dataset)
                plan = plan_for_node(
                    dataset,
                    sampler_args,
                    batch_size,
                    (begin, min(begin + PLAN_EPOCHS, end)),
                    node=node,
                    local_ranks=local_size,
                )
                write_plan(meta / "plan", plan, dataset, fingerprint)
                first_use = _first_use(plan)
                ProgressFile.create(meta / "progress", local_size)
                CounterFile.create(meta / "counters", local_size)
                cap = parse_capacity(capacity, stage_dir)
                proc = _launch(binary, stage_dir, threads, cap, verify)
                ok, why = _wait_running(proc, meta / "status")
                info = dict(
                    ok=ok,
                    why=why,
                    steps=plan.steps_per_epoch,
                    created=created,
                    fingerprint=fingerprint,
                )
            except Exception as exc:  # noqa: BLE001 (sent to the node's other ranks first)
                info = dict(error=f"{type(exc).__name__}: {exc}")
        info = node_comm.bcast(info, root=0)
        if "error" in info:
            if proc is not None:
                proc.kill()
            raise RuntimeError(f"staging into {stage_dir} could not start: {info['error']}")
        session = cls(
            world=world,
            node_comm=node_comm,
            dataset=dataset,
            sampler_args=dict(sampler_args),
            batch_size=batch_size,
            begin=begin,
            end=end,
            plan_begin=begin,
            stage_dir=stage_dir,
            meta=meta,
            created=info["created"],
            keep=keep,
            local_rank=local_rank,
            local_size=local_size,
            node=node,
            proc=proc,
            steps_per_epoch=info["steps"],
            fingerprint=info["fingerprint"],
            status=StatusView(meta / "status"),
            progress=ProgressFile(meta / "progress", local_size),
            counters=CounterFile(meta / "counters", local_size),
            warned=False,
            dead=not info["ok"],
            last_check=0.0,
            closed=False,
            first_use=first_use,
        )
        if not info["ok"]:
            session._warn(f"the staging process did not start ({info['why']})")
        return session

    # ------------------------------------------------------------------ trainer API

    def locator(self) -> Locator:
        """Picklable file_id -> Path for the loader (and its worker processes)."""
        return Locator(
            self.stage_dir,
            Path(self.dataset.root),
            [f.relpath for f in self.dataset.files],
            self.local_rank,
            self.local_size,
        )

    def consumed(self, epoch: int, step: int) -> None:
        """This rank has finished reading steps [0, step) of epoch."""
        self.progress.set(self.local_rank, epoch * self.steps_per_epoch + step)
        if self.local_rank == 0 and epoch > self.plan_begin and epoch + 1 < self.end:
            self._replan(epoch)
        now = time.monotonic()
        if now - self.last_check > 1.0:
            self.last_check = now
            self._check_alive()

    def progress_record(self) -> dict[str, int] | None:
        """Node view for hpcdl.report (local rank 0; None elsewhere): files of the current plan
        staged (READY) vs files the slowest local rank has already needed."""
        if self.first_use is None:
            return None
        done = min(self.progress.get(r) for r in range(self.local_size))
        cursor = done - self.plan_begin * self.steps_per_epoch
        return {
            "files_ready": int(self.status.field("plan_ready")),
            "consumed_files": int(np.searchsorted(self.first_use, cursor, side="left")),
            "plan_files": len(self.first_use),
        }

    def epoch_stats(self) -> dict[str, Any]:
        """Cumulative since start: node's files/bytes staged, this rank's hits/misses, liveness."""
        hits, misses = self.counters.totals(self.local_rank)
        self._check_alive()
        return {
            "files_staged": int(
                self.status.field("files_staged") + self.status.field("files_reused")
            ),
            "bytes_staged": int(
                self.status.field("bytes_staged") + self.status.field("bytes_reused")
            ),
            "hits": int(hits),
            "misses": int(misses),
            "stager_alive": not self.dead,
        }

    def close(self) -> None:
        """Stop the stager (local rank 0), then remove staged files unless keep. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.node_comm.Barrier()  # every local rank has finished reading
        if self.local_rank == 0:
            if self.proc is not None:
                _stop(self.proc)
            remove_temporaries(self.stage_dir)
            if not self.keep:
                remove_staged(self.stage_dir, [f.relpath for f in self.dataset.files], self.created)
        self.status.close()
        self.progress.close()
        self.counters.close()
        self.node_comm.Barrier()

    # ------------------------------------------------------------------ internals

    def _replan(self, epoch: int) -> None:
        self.plan_begin = epoch
        plan = plan_for_node(
            self.dataset,
            self.sampler_args,
            self.batch_size,
            (epoch, min(epoch + PLAN_EPOCHS, self.end)),
            node=self.node,
            local_ranks=self.local_size,
        )
        write_plan(self.meta / "plan", plan, self.dataset, self.fingerprint)
        self.first_use = _first_use(plan)

    def _check_alive(self) -> None:
        if self.dead:
            return
        alive = (self.proc.poll() is None) if self.proc is not None else True
        if alive:
            alive = stager_alive(self.status, HEARTBEAT_TIMEOUT_S)
        if not alive:
            self.dead = True
            self._warn("the staging process stopped")

    def _warn(self, what: str) -> None:
        self.dead = True
        if not self.warned:
            self.warned = True
            warnings.warn(
                f"hpcdl staging on node {self.node}: {what}; files not yet staged in "
                f"{self.stage_dir} are read from the parallel file system",
                RuntimeWarning,
                stacklevel=3,
            )


def _launch(
    binary: Path,
    stage_dir: Path,
    threads: int,
    capacity: int,
    verify: bool,
    once: bool = False,
    quiet: bool = False,
) -> subprocess.Popen:
    cmd = [
        str(binary),
        "--stage-dir",
        str(stage_dir),
        "--threads",
        str(int(threads)),
        "--capacity",
        str(int(capacity)),
        "--parent-pid",
        str(os.getpid()),
    ]
    if verify:
        cmd.append("--verify")
    if once:
        cmd.append("--once")
    if quiet:
        cmd.append("--quiet")
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL)


def _wait_running(proc: subprocess.Popen, status_path: Path) -> tuple[bool, str]:
    """Wait until the stager publishes RUNNING (or exits); never longer than START_TIMEOUT_S."""
    view = StatusView(status_path)
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            code = proc.poll()
            if (
                view.open()
                and view.field("pid") == proc.pid
                and view.field("run_state") >= RUN_RUNNING
            ):
                return True, ""
            if code is not None:
                return False, f"hpcdl-stage exited with code {code}; see its message above"
            if view._map is not None and view.field("pid") != proc.pid:
                view.close()  # an older status file; the stager replaces it
            time.sleep(0.01)
        return False, f"hpcdl-stage did not report RUNNING within {START_TIMEOUT_S:.0f} s"
    finally:
        view.close()


def _stop(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def remove_temporaries(stage_dir: Path) -> int:
    """Remove temporary copies left by a killed stager; returns how many."""
    removed = 0
    for dirpath, dirnames, filenames in os.walk(stage_dir):
        if Path(dirpath) == stage_dir and ".hpcdl" in dirnames:
            dirnames.remove(".hpcdl")
        for name in filenames:
            if name.startswith(".") and ".hpcdl-tmp." in name:
                try:
                    os.unlink(os.path.join(dirpath, name))
                    removed += 1
                except FileNotFoundError:
                    pass
    return removed


def remove_staged(stage_dir: Path, relpaths: list[str], remove_dir: bool) -> None:
    """Remove the data set's staged copies, hpcdl's metadata and the directories left empty."""
    dirs = set()
    for rel in relpaths:
        path = stage_dir / rel
        try:
            if not path.is_symlink() and path.is_file():
                path.unlink()
        except FileNotFoundError:
            pass
        parent = Path(rel).parent
        while str(parent) not in ("", "."):
            dirs.add(parent)
            parent = parent.parent
    shutil.rmtree(stage_dir / ".hpcdl", ignore_errors=True)
    for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
        try:
            (stage_dir / d).rmdir()
        except OSError:
            pass
    if remove_dir:
        try:
            stage_dir.rmdir()
        except OSError:
            pass


def _first_use(plan: Any) -> np.ndarray:
    """(F,) int64 first step (relative to the plan's first epoch) of each entry, ascending."""
    return np.array([t[0] for t in plan.ticks], dtype=np.int64)
