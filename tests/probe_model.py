"""Test-only user model (`--model tests/probe_model.py:probe_mlp`): a small MLP behind a layer
that watches the training batches. Lives in tests/ only; the product has no such hook.

- HPCDL_PROBE_RECORD=DIR: every training forward appends one line to DIR/rank-R.txt listing
  the batch's samples by the value of their first pixel. Data sets made for these tests store
  each sample's index there (sample_index_h5), so the lines are the sample indices each rank
  trained on, step by step.
- HPCDL_PROBE_SLOW=SECONDS:CKPT_DIR: every training forward sleeps SECONDS, but only in a run
  that started while CKPT_DIR held no checkpoint. The first job of a chain is then certainly
  cut by its time limit, and the jobs that resume it run at full speed. Without CKPT_DIR
  (`HPCDL_PROBE_SLOW=SECONDS:`) every run sleeps.
- HPCDL_PROBE_HOLD=STEP:DIR: the process that writes the checkpoint of global step STEP (rank
  0) writes its temporary file whole, then creates DIR/holding and waits there, never
  publishing it, until the test kills it: a loss during a checkpoint write, at a known point.
  Once per job: a process that finds DIR/holding writes on.
- HPCDL_PROBE_HOLD_RECOVERY=DIR: a survivor of a lost rank (--on-node-loss continue), after
  its shrink, creates DIR/recovering-R (R: its OMPI_COMM_WORLD_RANK) and waits for DIR/go
  before it builds the new world: the test kills one more rank while the survivors recover.

The probe has no parameters, so the model trains bit for bit as the same MLP without it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from hpcdl import checkpoint
from hpcdl.comm import ulfm
from hpcdl.nn.layers import Flatten, Layer, Linear, ReLU


class Probe(Layer):
    """Identity that records and may slow the training forwards (module notes)."""

    keeps_precision = True

    def __init__(self) -> None:
        super().__init__()
        rank = os.environ.get("OMPI_COMM_WORLD_RANK", "0")
        record = os.environ.get("HPCDL_PROBE_RECORD")
        self.record = Path(record) / f"rank-{rank}.txt" if record else None
        self.sleep_s = 0.0
        slow = os.environ.get("HPCDL_PROBE_SLOW")
        if slow:
            seconds, ckpt_dir = slow.split(":", 1)
            first = not ckpt_dir or not checkpoint.list_checkpoints(ckpt_dir)
            self.sleep_s = float(seconds) if first else 0.0
        hold = os.environ.get("HPCDL_PROBE_HOLD")
        if hold and not isinstance(checkpoint._write_h5, HeldWrite):
            step, directory = hold.split(":", 1)
            checkpoint._write_h5 = HeldWrite(checkpoint._write_h5, int(step), Path(directory))
        recovery = os.environ.get("HPCDL_PROBE_HOLD_RECOVERY")
        if recovery and not isinstance(ulfm.build_world, HeldRecovery):
            ulfm.build_world = HeldRecovery(ulfm.build_world, Path(recovery))

    def forward(self, x, train=True):
        if train and self.record is not None:
            samples = np.asarray(x[:, 0, 0, 0]).round().astype(np.int64)
            with open(self.record, "a") as fh:
                fh.write(" ".join(map(str, samples)) + "\n")
        if train and self.sleep_s:
            time.sleep(self.sleep_s)
        return x

    def backward(self, dy, ready=None):
        return dy


class HeldRecovery:
    """hpcdl.comm.ulfm.build_world that waits in a recovery (HPCDL_PROBE_HOLD_RECOVERY)."""

    def __init__(self, build, directory: Path) -> None:
        self.build, self.directory, self.held = build, directory, False

    def __call__(self, comm):
        if not self.held:  # the first recovery only
            self.held = True
            rank = os.environ.get("OMPI_COMM_WORLD_RANK", "0")
            (self.directory / f"recovering-{rank}").touch()
            while not (self.directory / "go").exists():
                time.sleep(0.01)
        return self.build(comm)


class HeldWrite:
    """hpcdl.checkpoint._write_h5 that holds at one checkpoint (HPCDL_PROBE_HOLD, module notes)."""

    def __init__(self, write, step: int, directory: Path) -> None:
        self.write, self.step, self.holding = write, step, directory / "holding"

    def __call__(self, path: str, ckpt) -> None:
        self.write(path, ckpt)
        if ckpt.global_step != self.step or self.holding.exists():
            return
        self.holding.write_text(path)
        while True:  # the test's SIGKILL ends it
            time.sleep(1)


def probe_mlp(input_shape, num_classes):
    c, h, w = input_shape
    return [Probe(), Flatten(), Linear(c * h * w, 32), ReLU(), Linear(32, num_classes)]


def sample_index_h5(path: Path, num_samples: int, num_classes: int = 4) -> Path:
    """An HDF5 data set of 1x4x4 float32 images whose first pixel is the sample's index."""
    import h5py  # noqa: PLC0415

    rng = np.random.default_rng(0)
    images = rng.standard_normal((num_samples, 1, 4, 4)).astype(np.float32)
    images[:, 0, 0, 0] = np.arange(num_samples)
    with h5py.File(path, "w") as f:
        f["images"] = images
        f["labels"] = rng.integers(0, num_classes, num_samples).astype(np.int64)
    return path


def recorded_steps(directory: Path, rank: int) -> list[list[int]]:
    """The sample indices of each training step of one rank, as the probe recorded them."""
    path = Path(directory) / f"rank-{rank}.txt"
    return [[int(i) for i in line.split()] for line in path.read_text().splitlines()]
