"""`bench calibrate`'s contention figure: the training time a node loses per file its stager copies.

A stager copies while the ranks train: epoch 1's files, and in every later epoch of a global
shuffle the next epoch's new files, from the PFS or from peers. Where the ranks and loaders keep
the node's cores busy (and on emulated nodes that share one host's cores), the copies take CPU
time, memory bandwidth and the file system client's attention from the steps. On a node with
cores to spare the figure is about 0, which is what it then measures.

It is measured, not derived: the trainer's step (bench calibrate's loop, batch building
included) is timed once quiet and once while every node's leader runs a real hpcdl-stage that
copies files of --data into a temporary directory of --stage-dir with --threads copy threads.
The steps' added seconds, over the copies published during the timed steps (their ctime, as
the stager renames each finished copy into place), give seconds per file and node. At most
--local-mb MB is copied; the directory is removed afterwards, with any stage dir made for it
(hpcdl.bench.stage_scratch). A copier that fails leaves the figure at 0, its last line in the
calibration's note.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcdl.bench.calibrate_peer import SESSION, WAIT_S, status_path, write_plan
from hpcdl.bench.stage_scratch import scratch_dir
from hpcdl.staging.binary import find_stager_binary
from hpcdl.staging.plan import FileTreeDataset
from hpcdl.staging.status import StatusView

MIN_FILES = 64  # copied per node at least: a window of a few steps must see some land


@dataclass(frozen=True)
class Window:
    """Step times of a timed run and when (time.time()) its timed steps began and ended."""

    seconds: list[float]
    began: float
    ended: float


def start_copier(data: Path, stage: Path, relpaths: list[str], sizes: list[int], threads: int):
    """hpcdl-stage copying these files of data into stage (one epoch, --once)."""
    write_plan(FileTreeDataset.of_files(data, relpaths, sizes), stage, 0, None)
    cmd = [str(find_stager_binary()), "--stage-dir", str(stage), "--session", SESSION,
           "--threads", str(threads), "--once", "--quiet"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    view = StatusView(status_path(stage))
    deadline = time.monotonic() + WAIT_S
    while not view.open() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)  # running: its status map is published
    return proc


def landed_between(stage: Path, began: float, ended: float) -> int:
    """Copies published into stage (under k/, write_plan's prefix) within [began, ended]."""
    count = 0
    for d, _dirs, names in os.walk(stage / "k"):
        for n in names:
            with contextlib.suppress(OSError):
                count += began <= (Path(d) / n).stat().st_ctime <= ended
    return count


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
    timed: Callable[[Callable[[], None]], Window],
) -> tuple[float, str]:
    """(seconds lost per file a node copies, a note) on every rank; collective.

    quiet_step_s: the trainer's mean step without copies; timed(at_start): runs the trainer's
    steps, calls at_start() as the timed ones begin (the copies start then, after the
    warm-up), and returns their Window."""
    with contextlib.ExitStack() as scratch:
        copies = None
        if world.local_rank == 0:
            where = scratch.enter_context(scratch_dir(stage_dir, ".hpcdl-calibrate-contention."))
            copies = Copies(load, where)
        return _timed_copies(world, quiet_step_s, timed, copies)


class Copies:
    """hpcdl-stage copying the load's files of --data into a node-local directory."""

    def __init__(self, load: CopyLoad, stage: Path) -> None:
        self.stage, self.load, self.procs = stage, load, []
        self.failed = ""  # the copier's last line, where it ended with an error

    def start(self) -> None:
        if self.load.relpaths:
            self.procs.append(start_copier(self.load.data, self.stage, self.load.relpaths,
                                           self.load.sizes, self.load.threads))  # fmt: skip

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
            try:
                _, err = proc.communicate(timeout=WAIT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
            if proc.returncode not in (0, -signal.SIGTERM):
                lines = (err or "").strip().splitlines()
                self.failed = f"exit {proc.returncode}: {lines[-1] if lines else 'no message'}"


def _timed_copies(world: Any, quiet_step_s: float, timed, copies: Copies | None):
    """(seconds per file, a note) of the copies started with the timed steps."""
    from mpi4py import MPI  # noqa: PLC0415

    from hpcdl.bench.timing import slowest_rank_mean  # noqa: PLC0415

    landed, failed = 0, ""
    try:
        window = timed(copies.start if copies else lambda: None)
        if copies is not None:
            landed = landed_between(copies.stage, window.began, window.ended)
    finally:
        if copies is not None:
            copies.close()
            failed = copies.failed
    loaded = slowest_rank_mean(world.comm, window.seconds)
    per_node = world.comm.allreduce(landed, op=MPI.SUM) / world.num_nodes
    failed = next((f for f in world.comm.allgather(failed) if f), "")
    if failed:
        return 0.0, f"not measured: a node's hpcdl-stage copying --data failed ({failed})"
    if per_node < 1:
        return 0.0, "not measured: no copy landed during the timed steps"
    lost = max(0.0, (loaded - quiet_step_s) * len(window.seconds))
    note = (f"step {loaded * 1e3:.1f} ms while {per_node:.0f} files per node landed in "
            f"{window.ended - window.began:.2f} s, {quiet_step_s * 1e3:.1f} ms quiet")  # fmt: skip
    return lost / per_node, note
