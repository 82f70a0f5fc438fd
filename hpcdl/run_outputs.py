"""Where a run writes: never inside its data.

NOTE [a run's outputs]
- A --checkpoint-dir, --metrics, --timeline or --tensorboard that is, or lies inside, --data or
  --val-data (symlinks resolved; a tar pattern's or one .tar's root is the directory of its
  shards, hpcdl.staging.ownership.data_root) is refused at start: a checkpoint is an .h5 file,
  and beside HDF5 shards the next run reads it as one; in an image folder a directory becomes a
  class. An output that contains the data, or sits beside it, writes nothing into it.
"""

from __future__ import annotations

import os
from pathlib import Path

from hpcdl.config import TrainConfig


def inside_data_error(cfg: TrainConfig) -> str | None:
    """The one line for the first output (checkpoint dir, metrics, timeline, tensorboard) that is
    or lies inside --data or --val-data; None when every output keeps out of the data."""
    from hpcdl.staging.ownership import data_root  # noqa: PLC0415

    outputs = {"--checkpoint-dir": cfg.checkpoint_dir, "--metrics": cfg.metrics,
               "--timeline": cfg.timeline, "--tensorboard": cfg.tensorboard}  # fmt: skip
    for flag, data in (("--data", cfg.data), ("--val-data", cfg.val_data)):
        if not data:
            continue
        given = data_root(data)
        root = Path(os.path.realpath(given))
        named = f"{flag} {data}" if given == Path(data) else f"{given}, the directory of {data}"
        for out_flag, out in outputs.items():
            if not out:
                continue
            where = Path(os.path.realpath(out))
            how = "is" if where == root else "lies inside" if root in where.parents else None
            if how:
                return (
                    f"{out_flag} {out} {how} {named}: its files would be read as part of the "
                    "data set; choose a path outside the data"
                )
    return None
