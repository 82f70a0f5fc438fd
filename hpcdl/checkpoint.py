"""HDF5 checkpoints: parameters, optimizer state, BatchNorm statistics, position and RNG state.

Written atomically: a temporary file in the checkpoint directory, flushed and fsync'ed, then
renamed over the final name, and the directory fsync'ed. A writer killed at any point leaves
the previous checkpoints intact and no file a reader would mistake for a checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from hpcdl.fsync import fsync_path

FORMAT_VERSION = 1
_NAME = re.compile(r"^ckpt-e(\d{5})-s(\d{9})\.h5$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used for this run; the message names file and field."""


@dataclass
class Checkpoint:
    model: str
    layout: list[tuple[str, tuple[int, ...]]]  # (param name, shape) in buffer order
    params: np.ndarray  # (P,) float32, host copy
    buffers: np.ndarray  # (S,) float32, BatchNorm running statistics
    optimizer: dict[str, np.ndarray]
    epoch: int  # epoch to continue in
    step_in_epoch: int  # steps of that epoch already done
    global_step: int
    rng_states: list[Any]  # per rank, JSON-able
    config: dict[str, Any] = field(default_factory=dict)
    world_size: int = 1


def checkpoint_name(epoch: int, global_step: int) -> str:
    return f"ckpt-e{epoch:05d}-s{global_step:09d}.h5"


def save(directory: str | os.PathLike, ckpt: Checkpoint, keep: int = 2) -> Path:
    """Write ckpt atomically into directory, keeping the newest `keep`; returns its path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / checkpoint_name(ckpt.epoch, ckpt.global_step)
    fd, tmp = tempfile.mkstemp(prefix=".ckpt-", suffix=".h5.tmp", dir=directory)
    os.close(fd)
    try:
        with h5py.File(tmp, "w") as f:
            f.attrs["format_version"] = FORMAT_VERSION
            f.attrs["model"] = ckpt.model
            f.attrs["layout"] = json.dumps([[n, list(s)] for n, s in ckpt.layout])
            f.attrs["epoch"] = ckpt.epoch
            f.attrs["step_in_epoch"] = ckpt.step_in_epoch
            f.attrs["global_step"] = ckpt.global_step
            f.attrs["world_size"] = ckpt.world_size
            f.attrs["rng_states"] = json.dumps(ckpt.rng_states)
            f.attrs["config"] = json.dumps(ckpt.config, sort_keys=True)
            f.create_dataset("params", data=ckpt.params)
            f.create_dataset("buffers", data=ckpt.buffers)
            opt = f.create_group("optimizer")
            for key, value in ckpt.optimizer.items():
                opt.create_dataset(key, data=np.asarray(value))
            f.flush()
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, final)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_path(directory)
    for old in list_checkpoints(directory)[:-keep]:
        old.unlink(missing_ok=True)
    return final


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Complete checkpoints in directory, oldest first (temporary files are never listed)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m[2]), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def latest(directory: str | os.PathLike) -> Path | None:
    found = list_checkpoints(directory)
    return found[-1] if found else None


def load(path: str | os.PathLike) -> Checkpoint:
    path = Path(path)
    try:
        f = h5py.File(path, "r")
    except OSError as exc:
        raise CheckpointError(f"checkpoint {path} cannot be opened as HDF5: {exc}") from None
    with f:
        version = int(f.attrs.get("format_version", -1))
        if version != FORMAT_VERSION:
            raise CheckpointError(
                f"checkpoint {path} has format version {version}, this hpcdl reads {FORMAT_VERSION}"
            )
        for key in ("params", "buffers", "optimizer"):
            if key not in f:
                raise CheckpointError(f"checkpoint {path} lacks the '{key}' entry")
        return Checkpoint(
            model=str(f.attrs["model"]),
            layout=[(n, tuple(s)) for n, s in json.loads(f.attrs["layout"])],
            params=f["params"][...],
            buffers=f["buffers"][...],
            optimizer={k: v[...] for k, v in f["optimizer"].items()},
            epoch=int(f.attrs["epoch"]),
            step_in_epoch=int(f.attrs["step_in_epoch"]),
            global_step=int(f.attrs["global_step"]),
            rng_states=json.loads(f.attrs["rng_states"]),
            config=json.loads(f.attrs["config"]),
            world_size=int(f.attrs["world_size"]),
        )


def check_compatible(
    ckpt: Checkpoint, path: str | os.PathLike, model: str, layout: list[tuple[str, tuple[int, ...]]]
) -> None:
    """Raise CheckpointError naming both models, or the first parameter whose shape differs."""
    if ckpt.model != model:
        raise CheckpointError(
            f"checkpoint {path} holds model '{ckpt.model}' but this run builds model '{model}'"
        )
    if len(ckpt.layout) != len(layout):
        raise CheckpointError(
            f"checkpoint {path} has {len(ckpt.layout)} parameter arrays, model '{model}' "
            f"here has {len(layout)} (different input shape or class count?)"
        )
    for (_, shape_c), (name_m, shape_m) in zip(ckpt.layout, layout, strict=True):
        if tuple(shape_c) != tuple(shape_m):
            raise CheckpointError(
                f"checkpoint {path}: parameter {name_m} has shape {tuple(shape_c)} in the "
                f"checkpoint but {tuple(shape_m)} in this model (different input shape or classes?)"
            )
