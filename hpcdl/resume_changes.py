"""What a --resume may change of the run its checkpoint was written by.

NOTE [flags changed at a resume]
Every epoch reads each sample once, in the order of the job's SamplerSpec: the data set's
sample count, --seed and --shuffle (hpcdl.data.sampler). A checkpoint taken mid-way through an
epoch continues that order from where it stopped (hpcdl.data.epoch_order), so resuming it with
another data set, --seed or --shuffle would read the rest of the epoch from another
permutation: some samples twice, some never. That is refused in one line naming the flag and
the checkpoint's value. At an epoch's end nothing of the order is left to keep: the change is
allowed and said, as a new epoch order. --lr, --momentum and --weight-decay may change at any
point (lowering the lr on purpose is common); the change is said in the same one line.
A checkpoint written before its sample count was recorded is not checked for another data set.
"""

from __future__ import annotations

import os
from typing import Any

from hpcdl.checkpoint import Checkpoint, CheckpointError
from hpcdl.config import TrainConfig

ORDER_FLAGS = ("seed", "shuffle")  # with the sample count: the epoch's order
SAID_FLAGS = ("lr", "momentum", "weight_decay")  # the update: allowed, said


def changes_line(
    ckpt: Checkpoint, path: str | os.PathLike, cfg: TrainConfig, samples: int | None
) -> str | None:
    """The line that names the flags this resume changes, or None; CheckpointError when one of
    them would break the order of the epoch the checkpoint stopped in (module notes). samples:
    this run's training samples (None: not checked)."""
    old, changes = ckpt.config, []
    where = f"checkpoint {path} stopped mid-way through epoch {ckpt.epoch + 1}"
    mid = _mid_epoch(ckpt)
    was = ckpt.data_samples
    if was is not None and samples is not None and was != samples:
        if mid:
            raise CheckpointError(
                f"{where} of --data {old.get('data')} ({was} samples); this --data {cfg.data} "
                f"holds {samples} samples: resume with the checkpoint's --data, or start afresh "
                "with another --checkpoint-dir"
            )
        changes.append(
            f"--data {old.get('data')} ({was} samples) to {cfg.data} ({samples} samples)"
        )
    for key in ORDER_FLAGS + SAID_FLAGS:
        before, now, flag = old.get(key), getattr(cfg, key), "--" + key.replace("_", "-")
        if before is None or before == now:
            continue
        if mid and key in ORDER_FLAGS and _orders(key, old):
            raise CheckpointError(
                f"{where}, read in the order of {flag} {before}; {flag} {now} would read the "
                "rest of it in another order (some samples twice, some never): resume with "
                f"{flag} {before}, or start afresh with another --checkpoint-dir"
            )
        changes.append(f"{flag} {before} to {now}")
    return "hpcdl: this run changes the checkpoint's " + ", ".join(changes) if changes else None


def _mid_epoch(ckpt: Checkpoint) -> bool:
    """The checkpoint stopped inside an epoch (a resharded epoch counts its samples done)."""
    if ckpt.epoch_order is not None:
        return bool(ckpt.epoch_order.get("samples_done"))
    return ckpt.step_in_epoch > 0


def _orders(key: str, old: dict[str, Any]) -> bool:
    """key sets the epoch's order in the checkpoint's run (--seed does not under --shuffle none)."""
    return key != "seed" or old.get("shuffle") != "none"
