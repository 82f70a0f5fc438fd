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
fp16's skip-or-apply reads the overflow flag on the host, unless it is decided on the device
(--gpu-kernels with SGD: NOTE [device loss scale] in hpcdl/nn/precision.py); then `applied`
is a 0-d array too, and a step with fp16 needs no host read either.

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
    applied = _unscale_and_update(parts, lr, updated)
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
    return StepResult(loss, logits, times, applied, model.step_flags[FLAG_LOSS].copy())


def _unscale_and_update(parts: StepParts, lr: Any, updated: bool) -> Any:
    """fp16's unscale (or skip), then the optimizer's update, unless the graph did both;
    whether it applied: True, False, or with the device loss scale a 0-d bool array (read
    when a record is written: NOTE [device loss scale] in hpcdl/nn/precision.py)."""
    model, scaler = parts.model, parts.scaler
    if updated:  # the graph's replay unscales and applies (fp16: under its device flag)
        return parts.graph.update()  # with a reducer: the update's graph, after its wait()
    agreed = _flags_agreed(parts)
    overflows = model.step_flags[FLAG_OVERFLOW : FLAG_OVERFLOW + 1]
    if scaler and fp16_decided_on_device(parts, agreed):
        apply = scaler.unscale_on_device(model.grads, overflows)
        parts.optimizer.step(lr, apply)
        return apply
    applied = scaler.unscale(model.grads, overflows, agreed) if scaler else True
    if applied:
        parts.optimizer.step(lr)
    return applied


def _flags_agreed(parts: StepParts) -> bool:
    """Whether the reducer sums the step's flags over the ranks with the gradients."""
    reducer = parts.reducer
    return reducer is not None and reducer.grads.size > parts.model.grads.size


def fp16_decided_on_device(parts: StepParts, agreed: bool) -> bool:
    """Whether fp16's skip-or-apply is decided on the device: the scaler asks for it and the
    optimizer can mask its update with the decision."""
    return parts.scaler.decides_on_device(agreed) and getattr(
        parts.optimizer, "masks_update", False
    )


def forward_backward(
    parts: StepParts, images: Any, labels: Any, mark_ready: Callable[[int], None] | None = None
) -> tuple[Any, Any, float]:
    """Forward, loss, the step's flags and backward (handing buckets to the reducer); returns
    (loss, logits, perf_counter() once forward was launched). What a CUDA graph captures.

    mark_ready: called with n when grads[:n] are final, in place of the reducer's own (a step
    cut at the bucket boundaries: hpcdl.nn.step_segments.BucketCuts)."""
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
    ranks = reducer.world_size if reducer else 1
    if parts.scaler and fp16_decided_on_device(parts, _flags_agreed(parts)):
        dlogits *= parts.scaler.scale_for(xp, ranks)  # a device scalar: no host read
    elif (scale := (parts.scaler.scale if parts.scaler else 1.0) / ranks) != 1.0:
        dlogits *= scale
    if reducer:
        reducer.begin_step()
    mark_ready = mark_ready or (reducer.mark_ready if reducer else None)
    ready = OverflowCheck(model, mark_ready) if parts.scaler else None
    model.backward(dlogits, grad_ready=ready or mark_ready)
    if ready:
        ready.finish()
    return loss, logits, tf


class OverflowCheck:
    """grad_ready for fp16: counts, in model.step_flags, the newly final gradient ranges that
    hold an inf or NaN before handing them on to the reducer (which sums them in place, so
    they must be checked first). finish() checks the rest once backward has ended."""

    def __init__(self, model: Any, mark_ready: Callable[[int], None] | None) -> None:
        self.grads, self.flag = model.grads, model.step_flags[FLAG_OVERFLOW : FLAG_OVERFLOW + 1]
        self.mark_ready = mark_ready  # the reducer's, or None (one rank)
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
