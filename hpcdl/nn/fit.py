"""Single-process training loop for tests, examples and benchmarks (no MPI, no loader).

Each step is hpcdl.nn.step.train_step, the step hpcdl.train runs, without a reducer."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from hpcdl.backend import array_module
from hpcdl.nn.loss import accuracy_count, softmax_cross_entropy
from hpcdl.nn.model import Model
from hpcdl.nn.step import StepParts, train_step


class NonFiniteLossError(FloatingPointError):
    """The training loss became NaN or infinite."""


def fit(
    model: Model,
    x: Any,
    y: Any,
    epochs: int,
    batch_size: int,
    optimizer: Any,
    lr: float | Callable[[int], float] = 0.01,
    seed: int = 0,
    x_val: Any = None,
    y_val: Any = None,
) -> dict[str, list[float]]:
    """Train on (x (N, C, H, W), y (N,) int64) with shuffled mini-batches; return the history.

    lr is a constant or a function of the global step (e.g. a `schedule.LrSchedule`). The
    last partial batch of an epoch is dropped. history has per-epoch "loss", "acc" and, with
    validation data, "val_loss" and "val_acc". A non-finite loss raises NonFiniteLossError
    after that step's update, as hpcdl.train stops after it.
    """
    if len(x) != len(y):
        raise ValueError(f"x has {len(x)} samples but y has {len(y)}")
    if not 1 <= batch_size <= len(x):
        raise ValueError(f"batch_size must be in [1, {len(x)}], got {batch_size}")
    xp = array_module(model.params)
    rng = np.random.default_rng(seed)
    lr_of = lr if callable(lr) else (lambda _step: lr)
    history: dict[str, list[float]] = {"loss": [], "acc": []}
    if x_val is not None:
        history.update(val_loss=[], val_acc=[])

    parts = StepParts(model, optimizer, xp)
    step = 0
    steps_per_epoch = len(x) // batch_size
    for epoch in range(epochs):
        order = rng.permutation(len(x))
        loss_sum, correct = 0.0, 0
        for b in range(steps_per_epoch):
            idx = xp.asarray(order[b * batch_size : (b + 1) * batch_size])
            xb, yb = x[idx], y[idx]
            result = train_step(parts, xb, yb, lr_of(step))
            loss = float(result.loss)  # a host read each step: fit is for small models
            if not math.isfinite(loss):
                raise NonFiniteLossError(
                    f"loss became {loss} at step {step} (epoch {epoch + 1}, batch {b}); "
                    f"lower the learning rate or check the input data"
                )
            loss_sum += loss
            correct += int(accuracy_count(result.logits, yb))
            step += 1
        history["loss"].append(loss_sum / steps_per_epoch)
        history["acc"].append(correct / (steps_per_epoch * batch_size))
        if x_val is not None:
            val_loss, val_acc = evaluate(model, x_val, y_val, batch_size)
            history["val_loss"].append(val_loss)
            history["val_acc"].append(val_acc)
    return history


def evaluate(model: Model, x: Any, y: Any, batch_size: int = 256) -> tuple[float, float]:
    """(mean loss, accuracy) over all of x in evaluation mode."""
    loss_sum, correct = 0.0, 0
    for start in range(0, len(x), batch_size):
        xb, yb = x[start : start + batch_size], y[start : start + batch_size]
        logits = model.forward(xb, train=False)
        loss, _ = softmax_cross_entropy(logits, yb)
        loss_sum += float(loss) * len(xb)
        correct += int(accuracy_count(logits, yb))
    return loss_sum / len(x), correct / len(x)
