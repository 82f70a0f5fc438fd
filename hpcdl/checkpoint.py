"""HDF5 checkpoints: parameters, optimizer state, BatchNorm statistics, position and RNG state.

Written atomically: a temporary file in the checkpoint directory, flushed and fsync'ed, then
renamed over the final name, and the directory fsync'ed. A writer killed at any point leaves
the previous checkpoints intact and no file a reader would mistake for a checkpoint.

The keep-N rotation deletes only checkpoints of the run that saves: files whose recorded run id
(`run_id`: made when a run starts afresh, carried over by --resume) is the saver's. Another
run's checkpoint, one written before run ids were recorded, and a user's file that happens to
bear a checkpoint's name are never deleted.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from hpcdl.atomic import out_of_space, reason, write_atomically
from hpcdl.comm.failure import UserError

FORMAT_VERSION = 1
_NAME = re.compile(r"^ckpt-e(\d{5})-s(\d{9})\.h5$")
DAMAGED = (
    "the file is damaged or was not written by hpcdl; resume from another checkpoint or start "
    "without --resume"
)


class CheckpointError(ValueError):
    """A checkpoint that cannot be used for this run; the message names file and field."""


class CheckpointWriteError(UserError):
    """A checkpoint could not be written (a full or read-only file system): one line."""


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
    loss_scale: dict[str, Any] | None = None  # --precision fp16: LossScaler.state_dict()
    # How the epoch in progress was being read (hpcdl.data.epoch_order.EpochOrder.to_json);
    # None in checkpoints written before it was recorded.
    epoch_order: dict[str, Any] | None = None
    # Mid-epoch: every rank's sums of the epoch so far, [steps, samples, loss sum, correct] per
    # rank, so that a resumed epoch reports the whole epoch's loss and accuracy; None at an
    # epoch's end and in checkpoints written before they were recorded.
    epoch_sums: list[list[float]] | None = None
    # The run whose checkpoints save() rotates (module notes); None: it rotates nothing.
    run_id: str | None = None
    # Samples of the training data set (hpcdl.resume_changes); None in older checkpoints.
    data_samples: int | None = None


def checkpoint_name(epoch: int, global_step: int) -> str:
    return f"ckpt-e{epoch:05d}-s{global_step:09d}.h5"


def save(directory: str | os.PathLike, ckpt: Checkpoint, keep: int = 2) -> Path:
    """Write ckpt atomically into directory, keeping the newest `keep` of its run (ckpt.run_id,
    module notes); returns its path.

    CheckpointWriteError names the file, the OS error and what to do (free space, or another
    directory)."""
    directory = Path(directory)
    final = directory / checkpoint_name(ckpt.epoch, ckpt.global_step)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        # hpcdl.atomic; the user's file, so the umask's mode, as the metrics file has
        write_atomically(final, lambda tmp: _write_h5(tmp, ckpt), mode=None)
    except OSError as exc:
        raise CheckpointWriteError(
            f"cannot write checkpoint {final}: {reason(exc)}; {what_to_do(exc, directory)}"
        ) from None
    if ckpt.run_id:
        ours = [p for p in list_checkpoints(directory) if recorded(p, "run_id") == ckpt.run_id]
        for old in ours[:-keep]:
            old.unlink(missing_ok=True)
    return final


def what_to_do(exc: OSError, directory: str | os.PathLike) -> str:
    """The advice for a write into --checkpoint-dir directory that failed with exc."""
    if out_of_space(exc):
        return f"free space in --checkpoint-dir {directory} or choose another one"
    return "choose a writable --checkpoint-dir"  # EACCES, EPERM, EROFS, not a directory, ...


def recorded(path: str | os.PathLike, key: str) -> str | None:
    """A checkpoint file's attribute `key` as text, without reading its arrays; None when the
    file has none or is not HDF5 (a user's file named as a checkpoint)."""
    try:
        with h5py.File(path, "r") as f:
            value = f.attrs.get(key)
    except OSError:
        return None
    return None if value is None else str(value)


def _write_h5(path: str, ckpt: Checkpoint) -> None:
    """ckpt as an HDF5 file at path (hpcdl.atomic's temporary file)."""
    with h5py.File(path, "w") as f:
        f.attrs["format_version"] = FORMAT_VERSION
        f.attrs["model"] = ckpt.model
        f.attrs["layout"] = json.dumps([[n, list(s)] for n, s in ckpt.layout])
        f.attrs["epoch"] = ckpt.epoch
        f.attrs["step_in_epoch"] = ckpt.step_in_epoch
        f.attrs["global_step"] = ckpt.global_step
        f.attrs["world_size"] = ckpt.world_size
        f.attrs["rng_states"] = json.dumps(ckpt.rng_states)
        f.attrs["config"] = json.dumps(ckpt.config, sort_keys=True)
        if ckpt.loss_scale is not None:
            f.attrs["loss_scale"] = json.dumps(ckpt.loss_scale)
        if ckpt.epoch_order is not None:
            f.attrs["epoch_order"] = json.dumps(ckpt.epoch_order)
        if ckpt.epoch_sums is not None:
            f.attrs["epoch_sums"] = json.dumps(ckpt.epoch_sums)
        if ckpt.run_id is not None:
            f.attrs["run_id"] = ckpt.run_id
        if ckpt.data_samples is not None:
            f.attrs["data_samples"] = ckpt.data_samples
        f.create_dataset("params", data=ckpt.params)
        f.create_dataset("buffers", data=ckpt.buffers)
        opt = f.create_group("optimizer")
        for key, value in ckpt.optimizer.items():
            opt.create_dataset(key, data=np.asarray(value))


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Complete checkpoints in directory, oldest first (temporary files are never listed)."""
    directory = Path(directory)
    try:  # not is_dir() first: a start-up's probe can make and remove it in between
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = [(int(m[2]), directory / n) for n in names if (m := _NAME.match(n))]
    return [p for _, p in sorted(found)]


def latest(directory: str | os.PathLike) -> Path | None:
    found = list_checkpoints(directory)
    return found[-1] if found else None


def load(path: str | os.PathLike) -> Checkpoint:
    """Read a checkpoint; CheckpointError names the file and what is missing or malformed."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist (or is not a file)")
    try:
        f = h5py.File(path, "r")
    except OSError as exc:
        raise CheckpointError(f"checkpoint {path} cannot be opened as HDF5: {exc}") from None
    with f:
        try:
            return _read(f, path)
        except OSError as exc:  # h5py: a truncated or damaged dataset
            raise CheckpointError(f"checkpoint {path} cannot be read ({exc}); {DAMAGED}") from None


def _read(f: h5py.File, path: Path) -> Checkpoint:
    version = _attr(f, path, "format_version", int)
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {path} has format version {version}, this hpcdl reads {FORMAT_VERSION}"
        )
    for key in ("params", "buffers", "optimizer"):
        if key not in f:
            raise CheckpointError(f"checkpoint {path} lacks the '{key}' entry; {DAMAGED}")
    ckpt = Checkpoint(
        model=_attr(f, path, "model", str),
        layout=_attr(f, path, "layout", _parse_layout),
        params=_vector(f, path, "params"),
        buffers=_vector(f, path, "buffers"),
        optimizer=_optimizer_state(f, path),
        epoch=_attr(f, path, "epoch", _count),
        step_in_epoch=_attr(f, path, "step_in_epoch", _count),
        global_step=_attr(f, path, "global_step", _count),
        rng_states=_attr(f, path, "rng_states", _parse_list_of_dicts),
        config=_attr(f, path, "config", _parse_dict),
        world_size=_attr(f, path, "world_size", _count),
        loss_scale=_attr(f, path, "loss_scale", _parse_dict) if "loss_scale" in f.attrs else None,
        epoch_order=_attr(f, path, "epoch_order", _parse_dict)
        if "epoch_order" in f.attrs
        else None,
        epoch_sums=_attr(f, path, "epoch_sums", _parse_sums) if "epoch_sums" in f.attrs else None,
        run_id=_attr(f, path, "run_id", str) if "run_id" in f.attrs else None,
        data_samples=_attr(f, path, "data_samples", _count) if "data_samples" in f.attrs else None,
    )
    if ckpt.epoch_sums is not None and len(ckpt.epoch_sums) != ckpt.world_size:
        raise CheckpointError(
            f"checkpoint {path} has the epoch's sums of {len(ckpt.epoch_sums)} ranks for a world "
            f"of {ckpt.world_size} ranks; {DAMAGED}"
        )
    if len(ckpt.rng_states) != ckpt.world_size:
        raise CheckpointError(
            f"checkpoint {path} has {len(ckpt.rng_states)} RNG states for a world of "
            f"{ckpt.world_size} ranks; {DAMAGED}"
        )
    return ckpt


def _attr(f: h5py.File, path: Path, key: str, parse: Callable[[Any], Any]) -> Any:
    if key not in f.attrs:
        raise CheckpointError(f"checkpoint {path} lacks the '{key}' attribute; {DAMAGED}")
    try:
        return parse(f.attrs[key])
    except (TypeError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
        raise CheckpointError(
            f"checkpoint {path} has an unreadable '{key}' attribute ({exc}); {DAMAGED}"
        ) from None


def _optional_dict(f: h5py.File, path: Path, key: str) -> dict[str, Any] | None:
    return _attr(f, path, key, _parse_dict) if key in f.attrs else None


def _count(value: Any) -> int:
    number = int(value)
    if number < 0 or number != value:
        raise ValueError(f"{value!r} is not a count")
    return number


def _parse_layout(text: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(str(name), tuple(_count(n) for n in shape)) for name, shape in json.loads(text)]


def _parse_sums(text: str) -> list[list[float]]:
    """epoch_sums: per rank [steps, samples, loss sum, correct], the counts whole numbers."""
    rows = json.loads(text)
    if not isinstance(rows, list) or any(not isinstance(r, list) or len(r) != 4 for r in rows):
        raise ValueError("not a list of [steps, samples, loss sum, correct] per rank")
    return [[_count(r[0]), _count(r[1]), float(r[2]), _count(r[3])] for r in rows]


def _parse_list_of_dicts(text: str) -> list[dict[str, Any]]:
    value = json.loads(text)
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise ValueError("expected a JSON list of objects")
    return value


def _parse_dict(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError("expected a JSON object")
    return value


def _vector(f: h5py.File, path: Path, key: str) -> np.ndarray:
    """A 1-D float dataset, read into memory."""
    data = f[key]
    if not isinstance(data, h5py.Dataset) or data.ndim != 1 or data.dtype.kind != "f":
        what = f"{data.dtype} {data.shape}" if isinstance(data, h5py.Dataset) else "a group"
        raise CheckpointError(
            f"checkpoint {path}: '{key}' is {what}, not a vector of floats; {DAMAGED}"
        )
    return data[...]


def _optimizer_state(f: h5py.File, path: Path) -> dict[str, np.ndarray]:
    group = f["optimizer"]
    if not isinstance(group, h5py.Group) or not all(
        isinstance(v, h5py.Dataset) for v in group.values()
    ):
        raise CheckpointError(f"checkpoint {path}: 'optimizer' is not a group of arrays; {DAMAGED}")
    return {key: value[...] for key, value in group.items()}


def check_model(ckpt: Checkpoint, path: str | os.PathLike, model: str) -> None:
    """Raise CheckpointError naming both models when ckpt holds another model than `model`
    (a name as checkpoints record it: a built-in name, 'module:function', 'torchvision:NAME')."""
    if ckpt.model != model:
        raise CheckpointError(
            f"checkpoint {path} holds model '{ckpt.model}' but this run builds model '{model}'"
        )


def check_same_arrays(
    ckpt: Checkpoint, path: str | os.PathLike, spec: str, layout: list[tuple[str, tuple[int, ...]]]
) -> None:
    """Raise CheckpointError naming the first parameter array whose name or shape differs
    between ckpt and layout, the arrays of the model `spec` builds: what a user's builder of
    another name than the checkpoint's (its file moved or was renamed) is held to."""
    theirs = [(name, tuple(shape)) for name, shape in ckpt.layout]
    ours = [(name, tuple(shape)) for name, shape in layout]
    if theirs == ours:
        return
    for (name_c, shape_c), (name_m, shape_m) in zip(theirs, ours, strict=False):
        if name_c == name_m and shape_c != shape_m:
            diff = f"{name_c} is {shape_c} in the checkpoint, {shape_m} there"
            break
        if name_c != name_m:
            diff = f"the checkpoint's {name_c} {shape_c} is {name_m} {shape_m} there"
            break
    else:
        diff = f"the checkpoint has {len(theirs)} parameter arrays, that model {len(ours)}"
    raise CheckpointError(
        f"checkpoint {path} holds model '{ckpt.model}', and model '{spec}' has other "
        f"parameters: {diff}; give the builder the run trained"
    )


def foreign(path: str | os.PathLike) -> str | None:
    """Why an existing file is no hpcdl checkpoint at all (not HDF5, or HDF5 without hpcdl's
    format_version: a data shard); None when it may be one (load says what is wrong)."""
    if not Path(path).is_file() or recorded(path, "format_version") is not None:
        return None
    return "an HDF5 file without hpcdl's format_version" if h5py.is_hdf5(path) else "not HDF5"


def check_compatible(
    ckpt: Checkpoint,
    path: str | os.PathLike,
    model: str,
    layout: list[tuple[str, tuple[int, ...]]],
    buffer_values: int | None = None,
) -> None:
    """Raise CheckpointError naming both models, the first parameter whose shape differs, or
    a parameter vector (or BatchNorm statistics, buffer_values long here) of the wrong length."""
    check_model(ckpt, path, model)
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
    needed = sum(int(np.prod(shape)) for _, shape in layout)
    if ckpt.params.size != needed:
        raise CheckpointError(
            f"checkpoint {path} has {ckpt.params.size} parameter values, model '{model}' has "
            f"{needed}; {DAMAGED}"
        )
    if buffer_values is not None and ckpt.buffers.size not in (0, buffer_values):
        raise CheckpointError(
            f"checkpoint {path} has {ckpt.buffers.size} BatchNorm statistics, model '{model}' "
            f"has {buffer_values}; {DAMAGED}"
        )
