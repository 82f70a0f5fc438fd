"""A training run: what it holds, where it starts, and how it closes. Built by startup.start_run.

NOTE [closing a run]
Everything a run holds (loaders, stager session, gradient reducer, SyncBN SumReducer, stop
agreement, metrics writer) is put on ONE contextlib.ExitStack as soon as it exists (`own`), so
whatever ends the run closes exactly what was made, newest first:
- Every rank leaves together: the loop ended, a signal stopped it, or an agreed error
  (SystemExitWithMessage: agree_on_errors, the NaN-loss check). Each resource closes normally,
  collectives included (the stager session's node barriers, the reducer's thread and
  communicator, the stop agreement's last allreduce).
- This rank leaves alone: any other exception (a data error, a bug in model code). The other
  ranks wait in a collective that will never complete, so nothing may call MPI: loaders stop
  their workers, the stager session stops the stager and removes what hpcdl staged unless
  --keep-staged, the metrics file is closed, the signal handlers are restored. The reducers'
  threads and communicators are left to MPI_Abort, which follows (hpcdl.comm.failure).
- Another rank failed: this rank's training thread is stuck in a collective and never unwinds.
  Its stager session is abandoned from the failure-notice thread instead
  (failure.cleanup_on_stand_down), before MPI_Abort ends the process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from hpcdl.comm.failure import StopAgreement, SystemExitWithMessage
from hpcdl.comm.world import World
from hpcdl.config import TrainConfig
from hpcdl.data.epoch_order import EpochOrder
from hpcdl.data.pool import Upcoming
from hpcdl.data.sampler import DistributedSampler
from hpcdl.engine import Engine
from hpcdl.metrics import MetricsWriter, Progress
from hpcdl.nn.schedule import LrSchedule


def own(stack: ExitStack, close: Callable[[], None], abandon: Callable[[], None] | None) -> None:
    """Put a resource on a run's stack: close() when every rank leaves together, abandon() when
    this rank leaves alone (None: nothing that may run then). NOTE [closing a run]."""

    def leave(exc_type: type[BaseException] | None, *_: Any) -> bool:
        if exc_type is None or issubclass(exc_type, SystemExitWithMessage):
            close()
        elif abandon is not None:
            abandon()
        return False  # the exception, if any, goes on

    stack.push(leave)


@dataclass(frozen=True)
class Position:
    """Where training continues: epoch and step in it (0-based), and the global step; order:
    how a resumed checkpoint's epoch was being read (None when starting afresh); run_id: the
    run the checkpoints continue (hpcdl.checkpoint rotates only its own), None where unused."""

    epoch: int = 0
    step_in_epoch: int = 0
    global_step: int = 0
    order: EpochOrder | None = None
    # this rank's sums of the epoch so far (steps, samples, loss sum, correct): a mid-epoch
    # checkpoint's, so that the resumed epoch's figures are the whole epoch's; () from 0
    epoch_sums: tuple[float, ...] = ()
    run_id: str | None = None


@dataclass(frozen=True)
class RestOfEpoch:
    """The end of an epoch another world size or batch began (NOTE [the rest of an epoch] in
    hpcdl/data/epoch_order.py): this rank's batches, and the order the epoch was read in."""

    epoch: int
    batches: list[np.ndarray]
    order: EpochOrder  # samples_done: what the checkpoint had read when this job started


@dataclass
class Run:
    """Everything one rank's training holds; a context manager that closes it all."""

    cfg: TrainConfig
    world: World
    xp: Any  # numpy or cupy: the model's array module
    cuda_aware: bool  # MPI takes device buffers
    host_staged: bool  # collectives go through host memory (GPU without a CUDA-aware MPI)
    train_ds: Any  # hpcdl.data data set
    val_ds: Any | None
    sampler: DistributedSampler  # this rank's view of the job's SamplerSpec
    engine: Engine  # the model, its optimizer and its step (NOTE [the engine seam])
    schedule: LrSchedule
    start: Position  # from --resume, else the beginning
    rest: RestOfEpoch | None  # finishing an epoch another world size began, else None
    loader: Any  # hpcdl.data.Loader of the training data
    val_loader: Any | None
    staging: Any | None  # hpcdl.staging.StagingSession with --stage-dir
    stop: StopAgreement
    metrics: MetricsWriter  # writes on rank 0 only
    progress: Progress
    stack: ExitStack  # owns every resource above (NOTE [closing a run])

    @property
    def steps_per_epoch(self) -> int:
        return self.sampler.steps_per_epoch(self.cfg.batch_size)

    @property
    def global_batch(self) -> int:
        return self.cfg.batch_size * self.world.size

    def resharded(self, epoch: int) -> bool:
        """This job reads epoch as the rest of one another world size began."""
        return self.rest is not None and epoch == self.rest.epoch

    def steps_in(self, epoch: int) -> int:
        return len(self.rest.batches) if self.resharded(epoch) else self.steps_per_epoch

    def epoch_order(self, at: Position) -> EpochOrder:
        """How the epoch of a checkpoint that continues at `at` is read, and how far."""
        done = at.step_in_epoch * self.global_batch
        if self.resharded(at.epoch):
            return replace(self.rest.order, samples_done=self.rest.order.samples_done + done)
        return EpochOrder(self.world.size, self.cfg.batch_size, self.world.ranks_by_node, done)

    def consumed(self, epoch: int, step: int) -> None:
        """Tell the stager that step is done: it may evict what is behind. Not in a resharded
        epoch, whose order the stager's plan (this job's sampler) does not know."""
        if self.staging and not self.resharded(epoch):
            self.staging.consumed(epoch, step)

    def epoch_batches(self, epoch: int) -> list[np.ndarray]:
        """This rank's sample indices of each step of epoch, in order."""
        if self.resharded(epoch):
            return self.rest.batches
        return self.sampler.batches(epoch, self.cfg.batch_size)

    def batches(self, epoch: int, first: int = 0) -> Iterator[tuple[Any, Any]]:
        """This rank's training batches of epoch from step `first`, as the engine's step takes
        them: images (B, C, H, W) float32, labels (B,) int64, valid until the next one."""
        order = self.epoch_batches(epoch)[first:]
        # the workers go on into the next epoch while the last steps of this one run
        then = None
        if epoch + 1 < self.cfg.epochs:
            then = Upcoming(self.epoch_batches(epoch + 1), epoch + 1, train=True)
        # a stop signal while waiting on a stalled worker: the loader builds the batch itself
        host = self.loader.iterate(
            order, epoch, train=True, stop_requested=self.stop.requested, then=then
        )
        # --decode gpu: decoded onto the run's array module by the loader itself
        return self.engine.batches(host, decoded=self.loader.decode == "gpu")

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: Any) -> bool:
        return bool(self.stack.__exit__(*exc))
