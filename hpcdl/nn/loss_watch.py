"""LossWatch: notes on the device whether a step's loss was not finite; the host reads it rarely.

NOTE [device scalars]: on a GPU, reading a value the device computed (float(loss), int(count),
bool(flag)) waits for every kernel queued before it, so the host can no longer run ahead and
launch the next step while this one computes. The step therefore leaves the loss, the correct
count and the non-finite flag as 0-d arrays on xp, and the trainer reads them every
--metrics-every steps, at the end of an epoch, and before a checkpoint or a stop: a non-finite
loss still stops every rank, with the step it first happened at, just up to --metrics-every - 1
steps later. Each step adds a handful of tiny kernels here and no transfer (the step number
goes in as a kernel argument).
"""

from __future__ import annotations

from typing import Any

import numpy as np


class LossWatch:
    """Counts the ranks whose loss was not finite, step after step, and keeps this rank's first
    such step (global step, epoch, loss): all 0-d arrays on xp until `first()` reads them."""

    def __init__(self, xp: Any = np) -> None:
        self.xp = xp
        self.ranks = xp.zeros((), xp.float64)  # sum of StepResult.nonfinite_ranks so far
        self.step = xp.full((), -1, xp.int64)  # this rank's first bad step; -1: none
        self.epoch = xp.full((), -1, xp.int64)
        self.loss = xp.zeros((), xp.float64)

    def note(self, nonfinite_ranks: Any, loss: Any, step: int, epoch: int) -> None:
        """Add one step's flag (StepResult.nonfinite_ranks) and loss; no host read. step: its
        number as the caller's logs give it (hpcdl.train's metrics: from 1)."""
        xp = self.xp
        self.ranks += nonfinite_ranks
        first = xp.logical_and(xp.logical_not(xp.isfinite(loss)), self.step < 0)
        self.loss[...] = xp.where(first, loss, self.loss)
        self.epoch[...] = xp.where(first, epoch, self.epoch)
        self.step[...] = xp.where(first, step, self.step)

    def any_rank_count(self) -> float:
        """The count so far (a host read)."""
        return float(self.ranks)

    def first(self) -> tuple[int, int, float] | None:
        """(global step, epoch, loss) of this rank's first non-finite loss, or None; a host read."""
        step = int(self.step)
        return None if step < 0 else (step, int(self.epoch), float(self.loss))
