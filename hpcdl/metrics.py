"""Per-step timing, Keras-style progress output and JSON-lines metrics (rank 0 only).

Format of the JSON lines: docs/internals.md, "Metrics JSONL".
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TextIO

from hpcdl.comm.failure import UserError
from hpcdl.config import progress_from_env
from hpcdl.nn.step import StepTimes  # the step's timing split; summed here

STEP_PARTS = ("t_data", "t_compute", "t_comm_exposed", "t_update", "t_step")


@dataclass
class RunningMean:
    """Sums of step parts and loss/accuracy over an epoch or a run.

    loss_sum and correct may be 0-d device arrays (NOTE [device scalars] in
    hpcdl/nn/loss_watch.py): adding to them stays on the device; `loss` and `acc` read them."""

    steps: int = 0
    samples: int = 0
    loss_sum: Any = 0.0  # float64 sum
    correct: Any = 0
    parts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STEP_PARTS, 0.0))

    def add(self, times: StepTimes, loss: Any, correct: Any, samples: int) -> None:
        self.steps += 1
        self.samples += samples
        # float64 as a Python float would sum it: a float32 loss must not narrow the sum
        self.loss_sum = self.loss_sum + (
            loss.astype("float64") if hasattr(loss, "astype") else loss
        )
        self.correct = self.correct + correct
        for name in STEP_PARTS:
            self.parts[name] += getattr(times, name)

    def mean_parts(self) -> dict[str, float]:
        return {k: v / max(1, self.steps) for k, v in self.parts.items()}

    @property
    def loss(self) -> float:
        return float(self.loss_sum) / max(1, self.steps)

    @property
    def acc(self) -> float:
        return int(self.correct) / max(1, self.samples)


class MetricsError(UserError):
    """The metrics file cannot be opened or written (a full disk, say): one line, no traceback."""


class MetricsWriter:
    """Appends JSON lines to a file; a no-op when path is None (every rank but 0).

    An existing file is appended to, not replaced: the trainer's first record of every run is a
    `start` event, which is where hpcdl.report splits a file into runs. Each record is one
    write(2); a record that does not fit (ENOSPC) is cut off again, so the file stays whole
    lines that hpcdl.report can read, and MetricsError names the file.

    tensorboard: also hand every record to it (hpcdl.tensorboard_events, --tensorboard), with
    or without a file."""

    def __init__(self, path: str | None, tensorboard: Any = None) -> None:
        self.path = path
        self.tensorboard = tensorboard
        self._fd: int | None = None
        self._size = 0  # bytes in the file up to the end of the last whole record
        if path:
            try:
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
                self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
                self._size = os.fstat(self._fd).st_size
            except OSError as exc:
                raise MetricsError(
                    f"cannot open --metrics {path}: {exc.strerror or exc}; give a file in a "
                    "writable directory"
                ) from None

    def write(self, event: str, **fields: Any) -> None:
        if self.tensorboard is not None:
            self.tensorboard.record(event, fields)
        if self._fd is None:
            return
        record = {"event": event, "time": time.time(), **fields}
        line = (json.dumps(record, default=_jsonable) + "\n").encode()
        try:
            left = memoryview(line)
            while left:
                left = left[os.write(self._fd, left) :]
        except OSError as exc:
            self._give_up()
            raise MetricsError(
                f"cannot write --metrics {self.path}: {exc.strerror or exc}; free space there "
                "or write the metrics to another file system"
            ) from None
        self._size += len(line)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None

    def _give_up(self) -> None:
        """Cut off a partly written record and stop writing."""
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, self._size)
        self.close()


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    return str(value)


LAUNCHERS = ("prterun", "mpirun", "mpiexec", "orterun", "prted", "orted", "hydra_pmi_proxy")


def resolve_progress(mode: str, stream: TextIO, environ: Mapping[str, str] | None = None) -> str:
    """The progress style for `--progress mode`: bar, epoch or none; auto decides here.

    auto takes $HPCDL_PROGRESS when set (the sbatch templates set epoch), else a live bar only
    when the launcher's own output is a terminal. Under mpirun the rank's stdout is a pty that
    Open MPI reads and forwards, so isatty() says yes even when the job's output goes to a file:
    what counts is the stdout of the launcher process above this one (mpirun, prterun, prted).
    Without a launcher (a singleton run, srun without --pty) the stream's own isatty() is right.
    """
    env = os.environ if environ is None else environ
    if mode != "auto":
        return mode
    chosen = progress_from_env(env)
    if chosen not in (None, "auto"):
        return chosen
    launcher_tty = launcher_stdout_is_terminal()
    if launcher_tty is None:
        launcher_tty = stream.isatty()
    return "bar" if launcher_tty else "epoch"


def launcher_stdout_is_terminal(pid: int | None = None) -> bool | None:
    """Whether the nearest MPI launcher above this process writes to a terminal (Linux /proc).

    None when no launcher is among the ancestors, or /proc cannot tell."""
    pid = os.getppid() if pid is None else pid
    try:
        while pid > 1:
            proc = f"/proc/{pid}"
            with open(f"{proc}/comm") as fh:
                name = fh.read().strip()
            if name in LAUNCHERS:
                target = os.readlink(f"{proc}/fd/1")
                return target.startswith(("/dev/pts/", "/dev/tty", "/dev/console"))
            with open(f"{proc}/stat") as fh:  # pid (comm) state ppid ...; comm may hold spaces
                pid = int(fh.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


class Progress:
    """Keras-style progress on rank 0: a live bar (bar) or one line per epoch (epoch).

    enabled=False (other ranks, --quiet) writes nothing at all; mode none keeps the start-up
    lines (say) and drops the progress. The epoch line is one whole line, written once at the
    end of the epoch: a job log gets exactly one line per epoch and no carriage returns."""

    WIDTH = 30

    def __init__(
        self,
        epochs: int,
        steps: int,
        enabled: bool,
        stream: TextIO | None = None,
        mode: str = "auto",
    ) -> None:
        self.epochs = epochs
        self.steps = steps
        self.enabled = enabled
        self.stream = stream or sys.stdout
        self.mode = resolve_progress(mode, self.stream) if enabled else "none"
        self.live = self.mode == "bar"
        self._epoch = 0
        self._epoch_start = time.perf_counter()

    def start_epoch(self, epoch: int) -> None:
        self._epoch = epoch
        self._epoch_start = time.perf_counter()
        if self.live:
            self.stream.write(f"Epoch {epoch + 1}/{self.epochs}\n")
            self.stream.flush()

    def _bar(self, done: int) -> str:
        filled = int(self.WIDTH * done / max(1, self.steps))
        arrow = ">" if filled < self.WIDTH else ""
        bar = "=" * max(0, filled - (1 if arrow else 0)) + arrow
        width = len(str(self.steps))
        return f"{done:>{width}}/{self.steps} [{bar:<{self.WIDTH}}]"

    def update(self, done: int, stats: RunningMean) -> None:
        """Redraw the bar after `done` steps; reads stats' loss and accuracy only when live."""
        if not self.live:
            return
        loss, acc = stats.loss, stats.acc
        elapsed = time.perf_counter() - self._epoch_start
        eta = elapsed / max(1, done) * (self.steps - done)
        self.stream.write(
            f"\r{self._bar(done)} - ETA: {eta:.0f}s - loss: {loss:.4f} - acc: {acc:.4f}"
        )
        self.stream.flush()

    def end_epoch(self, done: int, values: dict[str, float]) -> None:
        if self.mode == "none":
            return
        elapsed = time.perf_counter() - self._epoch_start
        per_step = elapsed / max(1, done) * 1000
        text = " - ".join(f"{k}: {v:.4f}" for k, v in values.items())
        timing = f"{elapsed:.0f}s {per_step:.0f}ms/step - {text}"
        if self.live:
            self.stream.write(f"\r{self._bar(done)} - {timing}\n")
        else:
            self.stream.write(
                f"Epoch {self._epoch + 1}/{self.epochs} - {done}/{self.steps} - {timing}\n"
            )
        self.stream.flush()

    def say(self, line: str) -> None:
        if self.enabled:
            self.stream.write(line + "\n")
            self.stream.flush()
