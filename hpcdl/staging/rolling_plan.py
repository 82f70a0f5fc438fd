"""RollingPlan: the plan a node's stager holds through one run, rolled forward epoch by epoch.

The stager always holds a plan for the current and the next epoch (PLAN_EPOCHS); local rank 0
writes the first before the stager starts and the next at each epoch change, and the stager
reloads it. Every local rank keeps the plan's shape (steps per epoch, the data set's
fingerprint) from the start broadcast; local rank 0 also keeps when each entry is first read,
for the progress record and the first epoch's outran check (hpcdl.staging.outran).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from hpcdl.data.sampler import SamplerSpec
from hpcdl.staging.plan import NodePlan, plan_for_node, write_plan

PLAN_EPOCHS = 2  # the stager always holds a plan for the current and the next epoch


class RollingPlan:
    """What one node reads in epochs [begin, end), and the plan its stager holds now."""

    def __init__(
        self,
        dataset: Any,
        sampler: SamplerSpec,
        batch_size: int,
        epochs: tuple[int, int],
        node: int,
        ranks: tuple[int, ...],
    ):
        self.dataset = dataset
        self.sampler = sampler  # every rank's reading order
        self.batch_size = batch_size
        self.begin, self.end = epochs  # epochs [begin, end) of this run
        self.node, self.ranks = node, ranks  # node index; the world ranks on it
        self.held = self.begin  # first epoch of the plan the stager holds
        self.steps_per_epoch = 0  # 0: no plan written (staging off)
        self.fingerprint = ""  # the data set's, as written in the plan
        self.first_use: np.ndarray | None = None  # (F,) first step of each entry (rank 0)
        self.first_epoch_need: tuple[int, int] | None = None  # (files, bytes) of epoch begin
        # A run that may fetch pieces (hpcdl.staging.pieces): the slots every plan has, and
        # (local rank 0 of a node in the peer tier) split(shard plan, piece plan) -> the plan.
        self.slots: Any = None
        self.split: Callable[[NodePlan, NodePlan], NodePlan] | None = None

    def make(self, epoch: int) -> NodePlan:
        """The plan from `epoch` on (local rank 0), which is now the one held."""
        self.held = epoch
        epochs = (epoch, min(epoch + PLAN_EPOCHS, self.end))
        plan = plan_for_node(
            self.dataset, self.sampler, self.batch_size, epochs, ranks=self.ranks, node=self.node
        )
        if self.split is not None:
            pieces = plan_for_node(
                self.slots, self.sampler, self.batch_size, epochs, ranks=self.ranks, node=self.node
            )
            plan = self.split(plan, pieces)
        self.first_use = plan.first_use()
        if epoch == self.begin:
            first = self.first_use < plan.steps_per_epoch
            self.first_epoch_need = (int(first.sum()), int(plan.sizes[first].sum()))
        return plan

    def write(self, path: Path, plan: NodePlan, key: str, peer_lines: list[str]) -> None:
        """Write `plan` for the stager at path; key: the data set's tree in the stage dir."""
        write_plan(path, plan, self.dataset, self.fingerprint, key, peer_lines, self.slots)

    def due(self, epoch: int) -> bool:
        """True when reaching `epoch` needs the next plan: it is past the held plan's first
        epoch and the run goes on after it."""
        return epoch > self.held and epoch + 1 < self.end

    def position(self, epoch: int, step: int) -> int:
        """A rank's cursor over the run's steps, as the progress file holds it."""
        return epoch * self.steps_per_epoch + step

    def files_needed(self, position: int) -> int:
        """Entries of the held plan first read before `position` (local rank 0)."""
        cursor = position - self.held * self.steps_per_epoch
        return int(np.searchsorted(self.first_use, cursor, side="left"))
