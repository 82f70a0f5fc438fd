"""One training step, the one every caller runs: hpcdl.train, the benchmarks and hpcdl.nn.fit.

forward -> the loss (StepParts.loss, softmax cross-entropy unless the caller gives another;
times the loss scale with --precision fp16) -> backward,
which hands each finished gradient bucket to the reducer as it goes (bucket readiness,
hpcdl.comm.reducer) -> wait for the last bucket -> (fp16: unscale, or skip the update on every
rank if any gradient overflowed) -> one fused optimizer update (-> parameter averaging for
--sync params:K), timed part by part (StepTimes, which hpcdl.metrics sums and reports). A
benchmark that calls train_step measures exactly what training runs.

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
from hpcdl.backend import synchronize
from hpcdl.nn.loss import softmax_cross_entropy


@dataclass
class StepTimes:
    """Seconds spent in each part of one training step (metrics.STEP_PARTS names them)."""

    t_data: float = 0.0  # waiting for the batch
    t_compute: float = 0.0  # forward + backward (+ host-device copies)
    t_comm_exposed: float = 0.0  # waiting for gradient buckets after backward ended
    t_update: float = 0.0  # optimizer step
    t_step: float = 0.0  # wall time of the whole step


class Reducer(Protocol):
    """What train_step needs of hpcdl.comm.reducer.GradientReducer."""

    world_size: int

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


@dataclass
class StepResult:
    loss: float  # mean loss of the batch
    logits: Any  # (B, K) float32 on xp, for accuracy counting
    times: StepTimes
    applied: bool = True  # False: a gradient overflowed (fp16) and every rank skipped the update


def train_step(
    parts: StepParts,
    images: Any,
    labels: Any,
    lr: float,
    mix_params: bool = False,
    waited_since: float | None = None,
) -> StepResult:
    """One data-parallel step on (images (B, C, H, W) float32, labels (B,) int64), both on xp.

    mix_params: average the parameters after the update (parts.average_params). waited_since:
    perf_counter() when the caller began waiting for this batch, so t_data and t_step include
    the wait; None: no wait is counted."""
    t0 = time.perf_counter()
    start = t0 if waited_since is None else waited_since
    model, reducer = parts.model, parts.reducer
    logits = model.forward(images, train=True)
    loss, dlogits = parts.loss(logits, labels)
    tf = time.perf_counter()  # forward ends (asynchronously on a GPU: the launch)
    diag.record(diag.Kind.FORWARD, t0, tf)
    # gradients of loss / N: their sum over the ranks is the average; x the loss scale
    scale = (parts.scaler.scale if parts.scaler else 1.0) / (reducer.world_size if reducer else 1)
    if scale != 1.0:
        dlogits *= scale
    if reducer:
        reducer.begin_step()
    model.backward(dlogits, grad_ready=reducer.mark_ready if reducer else None)
    synchronize(parts.xp)
    t1 = time.perf_counter()
    diag.record(diag.Kind.BACKWARD, tf, t1)
    if reducer:
        diag.RECORDER.enter(diag.Kind.COMM_WAIT, t1)  # the stall inspector sees this wait
        reducer.wait()  # gradients are now averaged over all ranks
    t2 = time.perf_counter()
    diag.record(diag.Kind.COMM_WAIT, t1, t2)
    applied = parts.scaler.unscale(model.grads) if parts.scaler else True
    if applied:
        parts.optimizer.step(lr)
    if mix_params:
        parts.average_params()
    synchronize(parts.xp)
    t3 = time.perf_counter()
    diag.record(diag.Kind.OPTIMIZER, t2, t3)
    times = StepTimes(
        t_data=t0 - start, t_compute=t1 - t0, t_comm_exposed=t2 - t1, t_update=t3 - t2
    )
    times.t_step = t3 - start
    return StepResult(float(loss), logits, times, applied)
