"""Which configuration keys name files or directories: how a job file's relative paths are
read (relative to the file), and the error for a path given as "" (an unset variable).
hpcdl.config reads flags and TOML with them; hpcdl.launch and hpcdl.jobs read job files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpcdl.nn.user_models import is_user_model

# Keys naming files or directories; words that are not paths, per key.
PATH_KEYS = (
    "data",
    "val_data",
    "checkpoint_dir",
    "metrics",
    "stage_dir",
    "resume",
    "init_from",
    "tensorboard",
    "timeline",
)
_NOT_PATHS = {"resume": ("none", "auto")}
# What a path key wants, for the error when it is given empty ("$LOCAL_SCRATCH" unset).
_PATH_WANTS = {
    "config": "a TOML file",
    "data": "the training data's path",
    "val_data": "the validation data's path",
    "metrics": "a file",
    "resume": "auto, none or a checkpoint file",
    "init_from": "a weights file",
    "timeline": "a file",
}


def empty_path_error(name: str, source: str, what: str | None = None) -> str:
    """The error for path flag or key `name` given as "" in `source` ("command line" or the
    config file): most often an unset variable, never "no path". what: what it wants (default:
    a PATH_KEYS key's, else a directory)."""
    what = what or _PATH_WANTS.get(name, "a directory")
    flag = "--" + name.replace("_", "-")
    if source == "command line":
        leave = "" if name == "data" else " or leave the flag out"
        return f"{flag} is empty (an unset variable?); give {what}{leave}"
    leave = "" if name == "data" else " or leave the key out"
    return f"{flag} ({source}) is empty; give {what}{leave}"


def resolve_paths(values: dict[str, Any], config_path: str) -> dict[str, Any]:
    """`values` of a TOML file with its relative paths (PATH_KEYS) made relative to its directory.

    `data = "shards"` means the shards beside the config file, wherever the job starts; `~` is
    expanded. So does the file of `model = "nets/mine.py:build"` (a module spec or a built-in
    name is not a path). Values that are not strings are left for validation to reject.
    """
    base = Path(config_path).parent
    out = dict(values)
    for key in PATH_KEYS:
        value = out.get(key)
        if isinstance(value, str) and value and value not in _NOT_PATHS.get(key, ()):
            out[key] = str(base / Path(value).expanduser())
    model = out.get("model")
    if isinstance(model, str) and is_user_model(model):
        where, _, function = model.rpartition(":")
        if where.endswith(".py"):
            out["model"] = f"{base / Path(where).expanduser()}:{function}"
    return out
