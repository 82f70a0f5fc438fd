"""Learning-rate schedules: linear warmup, then step or cosine decay; linear scaling rule."""

from __future__ import annotations

import math
from dataclasses import dataclass

DECAYS = ("none", "cosine", "step")
STEP_MILESTONES = (0.5, 0.75)  # fractions of the post-warmup epochs where "step" divides by 10


def scaled_lr(base_lr: float, global_batch: int, base_batch: int) -> float:
    """Linear scaling rule (Goyal et al. 2017): lr grows in proportion to the global batch."""
    if global_batch < 1 or base_batch < 1:
        raise ValueError(f"batch sizes must be >= 1, got {global_batch} and {base_batch}")
    return base_lr * global_batch / base_batch


@dataclass(frozen=True)
class LrSchedule:
    """Learning rate as a function of the global step; call it with a step (0-based).

    Warmup rises linearly from base_lr / warmup_steps to base_lr over warmup_epochs; after it,
    "cosine" decays to 0 at total_epochs and "step" divides by 10 at 50% and 75% of the
    remaining epochs ("none": base_lr).
    """

    base_lr: float
    steps_per_epoch: int
    warmup_epochs: float = 0.0
    decay: str = "none"
    total_epochs: float = 1.0

    def __post_init__(self) -> None:
        if self.decay not in DECAYS:
            raise ValueError(f"lr decay must be one of {', '.join(DECAYS)}, got {self.decay!r}")

    def __call__(self, step: int) -> float:
        return lr_at(self, step)


def lr_at(schedule: LrSchedule, step: int) -> float:
    """Learning rate of `schedule` at global step `step` (0-based)."""
    base_lr = schedule.base_lr
    steps_per_epoch = max(1, schedule.steps_per_epoch)
    warmup_steps = schedule.warmup_epochs * steps_per_epoch
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    if schedule.decay == "none":
        return base_lr
    total_steps = schedule.total_epochs * steps_per_epoch
    progress = (step - warmup_steps) / max(1.0, total_steps - warmup_steps)
    progress = min(max(progress, 0.0), 1.0)
    if schedule.decay == "cosine":
        return base_lr * 0.5 * (1.0 + math.cos(math.pi * progress))
    return base_lr * 0.1 ** sum(progress >= m for m in STEP_MILESTONES)
