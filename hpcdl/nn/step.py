"""One training step, the one every caller runs: hpcdl.train, the benchmarks and hpcdl.nn.fit.

forward -> the loss (StepParts.loss, softmax cross-entropy unless the caller gives another;
times the loss scale with --precision fp16) -> backward,
which hands each finished gradient bucket to the reducer as it goes (bucket readiness,
hpcdl.comm.reducer) -> wait for the last bucket -> (fp16: unscale, or skip the update on every
rank if any gradient overflowed) -> one fused optimizer update (-> parameter averaging for
--sync params:K), timed part by part (StepTimes, which hpcdl.metrics sums and reports). A
benchmark that calls train_step measures exactly what training runs.

No host sync in the step (NOTE [device scalars]): the loss, the flag that says whether it was
finite and, with fp16, the overflow flag stay arrays on xp; the caller reads them when it
writes a record. Both flags live in Model.step_flags, after the gradients in the buffer the
reducer averages, so the gradient allreduce the step posts anyway makes every rank see every
rank's flags: no collective of their own. The step synchronizes the device only when `timed`
(the caller writes this step's times); on NumPy that is a no-op, so CPU results are unchanged.

Nothing here knows about MPI: the reducer and the parameter averaging come in as objects, so
hpcdl.nn.fit can use the step without importing hpcdl.comm. The step lives in hpcdl.nn because
it is model arithmetic; the layers above (the trainer, the benchmarks) hand it their reducer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from hpcdl import diag
from hpcdl.backend import array_module, synchronize
from hpcdl.nn.loss import softmax_cross_entropy
from hpcdl.nn.model import FLAG_LOSS, FLAG_OVERFLOW


@dataclass
class StepTimes:
    """Seconds spent in each part of one training step (metrics.STEP_PARTS names them)."""

    t_data: float = 0.0  # waiting for the batch
    t_compute: float = 0.0  # forward + backward (+ host-device copies)
    t_comm_exposed: float = 0.0  # waiting for gradient buckets after backward ended
    t_update: float = 0.0  # optimizer step
    t_step: float = 0.0  # wall time of the whole step


class Reducer(Protocol):
    """What train_step needs of hpcdl.comm.reducer.GradientReducer, built over
    model.grads_and_flags (or model.grads: then the flags stay this rank's own)."""

    world_size: int
    grads: Any

    def begin_step(self) -> None: ...
    def mark_ready(self, n: int) -> None: ...
    def wait(self) -> None: ...


@dataclass(frozen=True)
class StepParts:
    """What every step works on; built once per run (or benchmark)."""

    model: Any  # hpcdl.nn.Model: flat params and grads
    optimizer: Any  # one fused update over model.params (hpcdl.nn.optim)
    xp: Any = np  # the model's array module: device work is finished before each timestamp
    reducer: Reducer | None = None  # averages the gradients over the ranks; None: one rank
    average_params: Callable[[], None] | None = None  # --sync params:K: mean of the parameters
    scaler: Any = None  # --precision fp16: hpcdl.nn.precision.LossScaler; None: no loss scaling
    # (logits (B, K), labels (B,)) -> (mean loss, dlogits (B, K)); a profiler gives a timed one
    loss: Callable[[Any, Any], tuple[Any, Any]] = softmax_cross_entropy
    graph: Any = None  # --gpu-kernels: hpcdl.nn.step_graph.StepGraph replays forward + backward


@dataclass
class StepResult:
    loss: Any  # mean loss of the batch: a 0-d array on xp (float() reads it, a host sync)
    logits: Any  # (B, K) float32 on xp, for accuracy counting
    times: StepTimes
    applied: bool = True  # False: a gradient overflowed (fp16) and every rank skipped the update
    # 0-d array on xp: ranks whose loss was not finite, summed over the ranks when the
    # reducer carried the flags (every rank then holds the same count), else this rank's 0/1
    nonfinite_ranks: Any = 0.0


def train_step(
    parts: StepParts,
    images: Any,
    labels: Any,
    lr: float,
    mix_params: bool = False,
    waited_since: float | None = None,
    timed: bool = True,
) -> StepResult:
    """One data-parallel step on (images (B, C, H, W) float32, labels (B,) int64), both on xp.

    mix_params: average the parameters after the update (parts.average_params). waited_since:
    perf_counter() when the caller began waiting for this batch, so t_data and t_step include
    the wait; None: no wait is counted. timed: wait for the device before each timestamp, so
    the times are the device's; False: they are the host's launch times (no host sync)."""
    t0 = time.perf_counter()
    start = t0 if waited_since is None else waited_since
    model, reducer, xp = parts.model, parts.reducer, parts.xp
    updated = False  # the graph's replay applied the update too
    if parts.graph is not None and parts.graph.takes(parts, images):
        loss, logits, updated = parts.graph.replay(images, labels, lr)  # the step: one launch
        tf = t0
    else:
        loss, logits, tf = forward_backward(parts, images, labels)
    if timed:
        synchronize(xp)
    t1 = time.perf_counter()
    diag.record(diag.Kind.BACKWARD, tf, t1)
    if reducer:
        diag.RECORDER.enter(diag.Kind.COMM_WAIT, t1)  # the stall inspector sees this wait
        reducer.wait()  # gradients (and flags, when it carries them) are now summed over ranks
    t2 = time.perf_counter()
    diag.record(diag.Kind.COMM_WAIT, t1, t2)
    agreed = reducer is not None and reducer.grads.size > model.grads.size
    applied, flags = True, model.step_flags
    if parts.scaler:
        applied = parts.scaler.unscale(model.grads, flags[FLAG_OVERFLOW], agreed)
    if applied and not updated:
        parts.optimizer.step(lr)
    if mix_params:
        parts.average_params()
    if timed:
        synchronize(xp)
    t3 = time.perf_counter()
    diag.record(diag.Kind.OPTIMIZER, t2, t3)
    times = StepTimes(
        t_data=t0 - start, t_compute=t1 - t0, t_comm_exposed=t2 - t1, t_update=t3 - t2
    )
    times.t_step = t3 - start
    return StepResult(loss, logits, times, applied, flags[FLAG_LOSS].copy())


def forward_backward(parts: StepParts, images: Any, labels: Any) -> tuple[Any, Any, float]:
    """Forward, loss, the step's flags and backward (handing buckets to the reducer); returns
    (loss, logits, perf_counter() once forward was launched). What a CUDA graph captures."""
    t0 = time.perf_counter()
    model, reducer, xp = parts.model, parts.reducer, parts.xp
    logits = model.forward(images, train=True)
    loss, dlogits = parts.loss(logits, labels)
    flags = model.step_flags
    xp.logical_not(xp.isfinite(loss), out=flags[FLAG_LOSS : FLAG_LOSS + 1])  # on the device
    flags[FLAG_OVERFLOW] = 0
    tf = time.perf_counter()  # forward ends (asynchronously on a GPU: the launch)
    diag.record(diag.Kind.FORWARD, t0, tf)
    # gradients of loss / N: their sum over the ranks is the average; x the loss scale
    scale = (parts.scaler.scale if parts.scaler else 1.0) / (reducer.world_size if reducer else 1)
    if scale != 1.0:
        dlogits *= scale
    if reducer:
        reducer.begin_step()
    ready = OverflowCheck(model, reducer) if parts.scaler else None
    model.backward(dlogits, grad_ready=ready or (reducer.mark_ready if reducer else None))
    if ready:
        ready.finish()
    return loss, logits, tf


class OverflowCheck:
    """grad_ready for fp16: counts, in model.step_flags, the newly final gradient ranges that
    hold an inf or NaN before handing them on to the reducer (which sums them in place, so
    they must be checked first). finish() checks the rest once backward has ended."""

    def __init__(self, model: Any, reducer: Reducer | None) -> None:
        self.grads, self.flag = model.grads, model.step_flags[FLAG_OVERFLOW : FLAG_OVERFLOW + 1]
        self.mark_ready = reducer.mark_ready if reducer else None
        self.checked = 0  # grads[:checked] are counted

    def __call__(self, n: int) -> None:
        if n > self.checked:
            self.flag += ~_finite(self.grads[self.checked : n])
            self.checked = n
        if self.mark_ready:
            self.mark_ready(n)

    def finish(self) -> None:
        self(self.grads.size)


def _finite(x: Any) -> Any:
    """A 0-d bool on x's backend: every element of x is finite (no host read)."""
    return array_module(x).isfinite(x).all()
