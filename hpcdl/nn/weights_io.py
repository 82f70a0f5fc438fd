"""PyTorch state dicts in and out of a Model, over its name map (hpcdl.nn.weight_names).

Files: `.pth`/`.pt` (torch.save's zip format of a state dict, read and written by
hpcdl.nn.pth without PyTorch; reading is restricted as `weights_only=True` is, so a file can
hold tensors but never run code when unpickled) and `.safetensors` (needs only the
`safetensors` package, the `export` extra).

Loading checks the whole file against the model before it writes anything, so a file that does
not fit leaves the model as it was, and says why in one line: the key that is missing or
unexpected, or the key and both shapes. One mismatch is expected and allowed: the classifier
(the model's last layer with parameters) of another class count, when its input size agrees;
it keeps its fresh initialisation and `load_state` returns a line saying so (fine-tuning).
Arrays are cast to the model's dtype. Writing is atomic and never replaces a file: a temporary
file in the target's directory, fsync'ed, then hard-linked to the final name.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from hpcdl.atomic import out_of_space, reason, write_atomically
from hpcdl.backend import array_module, to_host
from hpcdl.nn.model import Model, leaf_names
from hpcdl.nn.pth import PthError, read_pth, write_pth
from hpcdl.nn.weight_names import WeightName, from_torch, head_leaf, to_torch, weight_names

TORCH_SUFFIXES = (".pth", ".pt")
SAFETENSORS_SUFFIXES = (".safetensors",)
WEIGHT_SUFFIXES = TORCH_SUFFIXES + SAFETENSORS_SUFFIXES
# (id(leaf), array name) -> (offset in model.params, shape)
Slices = dict[tuple[int, str], tuple[int, tuple[int, ...]]]


def state_dict(model: Model, batches_tracked: int = 0) -> dict[str, np.ndarray]:
    """The model's weights by PyTorch key, in PyTorch's layout: float arrays in the model's
    dtype, and num_batches_tracked as 0-d int64 arrays holding `batches_tracked`."""
    out, slices = {}, _param_slices(model)
    for name in weight_names(model):
        if name.form == "count":
            out[name.key] = np.array(batches_tracked, dtype=np.int64)
        else:
            out[name.key] = to_torch(_read(model, name, slices), name)
    return out


def load_state(model: Model, state: dict[str, np.ndarray], source: str) -> list[str]:
    """Copy a PyTorch-layout state dict into model (params and BatchNorm statistics).

    Returns the lines to tell the user (a re-initialised classifier); ValueError of one line,
    naming source and key, when the file does not fit the model (then nothing was changed)."""
    names, slices = weight_names(model), _param_slices(model)
    known = {name.key for name in names}
    for key, value in state.items():
        if key not in known:
            raise ValueError(
                f"{source}: unexpected key {key!r} {tuple(value.shape)}: model {model.name!r} "
                f"has no such array (its first keys: {', '.join(sorted(known)[:3])}, ...)"
            )
    head, fresh_head, notes = head_leaf(model), False, []
    for name in names:
        want = () if name.form == "count" else to_torch(_read(model, name, slices), name).shape
        if name.key not in state:
            if name.form == "count":
                continue  # PyTorch's own state dicts before 0.4.1 lack it too
            raise ValueError(
                f"{source}: missing key {name.key!r}: model {model.name!r} needs shape {want}, "
                "the file has none"
            )
        got = tuple(state[name.key].shape)
        if name.form == "count":
            if state[name.key].size != 1:
                raise ValueError(f"{source}: key {name.key!r} has shape {got}, expected ()")
        elif got != want:
            if name.leaf is head and got[1:] == want[1:]:
                if not fresh_head:
                    notes.append(
                        f"{source}: {name.key} is {got} there, {want} here: the final layer "
                        f"is re-initialised for {model.num_classes} classes"
                    )
                fresh_head = True
                continue
            raise ValueError(
                f"{source}: key {name.key!r} has shape {got} in the file but {want} in model "
                f"{model.name!r}; give weights of the same architecture"
            )
    for name in names:
        if name.form != "count" and not (fresh_head and name.leaf is head):
            _write(model, name, from_torch(np.asarray(state[name.key]), name), slices)
    return notes


def read_state(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """A state dict from a .pth/.pt or .safetensors file; ValueError of one line if not."""
    path = Path(path)
    if path.suffix in TORCH_SUFFIXES:
        return _read_torch(path)
    if path.suffix in SAFETENSORS_SUFFIXES:
        safetensors_numpy = optional_import("safetensors.numpy", "export", f"reading {path}")
        try:
            return dict(safetensors_numpy.load_file(str(path)))
        except Exception as exc:  # SafetensorError, OSError, a dtype NumPy lacks (bfloat16)
            raise ValueError(f"{path} cannot be read as safetensors: {_line(exc)}") from None
    raise ValueError(
        f"{path}: unknown weights format {path.suffix!r}; give a PyTorch state dict "
        f"({', '.join(TORCH_SUFFIXES)}) or a {SAFETENSORS_SUFFIXES[0]} file"
    )


def write_state(state: dict[str, np.ndarray], path: str | os.PathLike, to: str) -> None:
    """Write state as a PyTorch state dict (to='torch') or safetensors file (to='safetensors')."""
    if to == "torch":
        write_new_file(path, lambda tmp: write_pth(state, tmp))
    elif to == "safetensors":
        safetensors_numpy = optional_import("safetensors.numpy", "export", f"writing {path}")
        arrays = {k: np.ascontiguousarray(v) for k, v in state.items()}
        write_new_file(
            path, lambda tmp: safetensors_numpy.save_file(arrays, tmp, metadata={"format": "pt"})
        )
    else:
        raise ValueError(f"unknown weights format {to!r}; choose torch or safetensors")


def write_new_file(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """write(tmp_path) into a temporary file beside path, then publish it as path atomically;
    ValueError (one line) when path exists (a user's file is never replaced) or cannot be
    written (no temporary file is left)."""
    path = Path(path)
    if path.exists():
        raise ValueError(f"{path} exists; give a new file name (hpcdl never replaces a file)")
    try:
        # published by a link: never replaces; mode None: the user's umask, as open() gives
        write_atomically(path, write, replace=False, mode=None)
    except FileExistsError:  # path appeared meanwhile
        raise ValueError(f"{path} exists; give a new file name") from None
    except OSError as exc:
        todo = "free space there or give another directory" if out_of_space(exc) else ""
        raise ValueError(
            f"cannot write {path}: {reason(exc)}; {todo or 'give a writable directory'}"
        ) from None


def _read_torch(path: Path) -> dict[str, np.ndarray]:
    try:
        obj = read_pth(path)
    except (PthError, OSError) as exc:
        raise ValueError(
            f"{path} cannot be read as a PyTorch state dict (weights_only=True): {exc}"
        ) from None
    for wrapper in ("state_dict", "model"):  # checkpoints that hold the state dict under a key
        if isinstance(obj, dict) and isinstance(obj.get(wrapper), dict):
            obj = obj[wrapper]
    if not isinstance(obj, dict) or not all(isinstance(v, np.ndarray) for v in obj.values()):
        raise ValueError(f"{path} holds a {type(obj).__name__}, not a state dict of tensors")
    return {
        str(k): v.astype(np.float32) if np.issubdtype(v.dtype, np.floating) else v
        for k, v in obj.items()
    }


def _param_slices(model: Model) -> Slices:
    """{(id(leaf), attr): (offset, shape)} of every parameter in model.params."""
    by_name = {name: (off, shape) for name, shape, off in model.layout()}
    names = leaf_names(model.body)
    return {
        (id(leaf), spec.name): by_name[f"{names[id(leaf)]}.{spec.name}"]
        for leaf in model.body.leaves()
        for spec in leaf.param_specs
    }


def _read(model: Model, name: WeightName, slices: Slices) -> np.ndarray:
    """hpcdl's array for name, on the host. Parameters come from model.params (the float32
    masters under bf16/fp16, hpcdl.nn.precision), not from the layers' compute views."""
    if name.attr in name.leaf.b:
        return to_host(name.leaf.b[name.attr])
    off, shape = slices[(id(name.leaf), name.attr)]
    return to_host(model.params[off : off + int(np.prod(shape))]).reshape(shape)


def _write(model: Model, name: WeightName, value: np.ndarray, slices: Slices) -> None:
    xp = array_module(model.params)
    value = xp.asarray(value.astype(model.dtype))
    if name.attr in name.leaf.b:
        name.leaf.b[name.attr][...] = value
        return
    off, shape = slices[(id(name.leaf), name.attr)]
    model.params[off : off + int(np.prod(shape))] = value.reshape(-1)


def optional_import(module: str, extra: str, doing: str) -> Any:
    """Import an optional dependency, or one line saying which extra to install."""
    import importlib  # noqa: PLC0415

    try:
        return importlib.import_module(module)
    except ImportError:
        top = module.split(".")[0]
        raise ValueError(
            f"{doing} needs {top}, which is not installed: pip install 'hpcdl[{extra}]'"
        ) from None


def _line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
