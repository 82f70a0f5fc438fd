"""Users' own models: `--model package.module:function` or `--model path/to/file.py:function`.

The contract (docs/nn.md): `function(input_shape, num_classes, seed=..., xp=..., dtype=...)`
returns an `hpcdl.nn.Model` whose input_shape and num_classes are the ones it was given; the
arguments are those of `build_model`, input_shape being the (C, H, W) the loader yields. The
builder must be deterministic in seed (every rank builds the model; rank 0's parameters are
broadcast, but the layout must agree).

A module is imported with importlib (so it must be on sys.path: the current directory is, for
`python -m`); a file path (ending in .py, relative to the current directory) is loaded under a
private module name. Every failure is a ValueError of one sentence naming the spec and the fix.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from hpcdl.nn.model import Model

CONTRACT = "function(input_shape, num_classes, seed=, xp=, dtype=) returning an hpcdl.nn.Model"


def is_user_model(name: str) -> bool:
    """True for 'module:function' and 'file.py:function' specs (built-in names have no colon)."""
    return ":" in name


def load_builder(spec: str) -> Callable[..., Any]:
    """The callable a 'package.module:function' or 'file.py:function' spec names."""
    where, _, attr = spec.rpartition(":")
    if not where or not attr.isidentifier():
        raise ValueError(
            f"model {spec!r}: expected package.module:function or path/to/file.py:function"
        )
    module = _load_file(spec, Path(where)) if where.endswith(".py") else _import(spec, where)
    builder = getattr(module, attr, None)
    if builder is None:
        raise ValueError(f"model {spec!r}: {where} has no attribute {attr!r}")
    if not callable(builder):
        raise ValueError(
            f"model {spec!r}: {attr} is a {type(builder).__name__}, not a function; "
            f"give a {CONTRACT}"
        )
    return builder


def build_user_model(
    spec: str,
    input_shape: tuple[int, int, int],
    num_classes: int,
    seed: int = 0,
    xp: ModuleType = np,
    dtype: Any = np.float32,
) -> Model:
    """Call the builder spec names and check what it returns against the contract."""
    builder = load_builder(spec)
    try:
        model = builder(tuple(input_shape), num_classes, seed=seed, xp=xp, dtype=dtype)
    except Exception as exc:  # the user's code: report it in one line, whatever it raised
        raise ValueError(
            f"model {spec!r}: the builder raised {type(exc).__name__}: {exc}"
        ) from None
    if not isinstance(model, Model):
        raise ValueError(
            f"model {spec!r}: the builder returned a {type(model).__name__}, not an "
            f"hpcdl.nn.Model; it must be a {CONTRACT}"
        )
    if model.input_shape != tuple(input_shape) or model.num_classes != num_classes:
        raise ValueError(
            f"model {spec!r}: the builder returned a model for input {model.input_shape} and "
            f"{model.num_classes} classes, asked for {tuple(input_shape)} and {num_classes}; "
            "build it from the arguments it is given"
        )
    return model


def _import(spec: str, name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise ValueError(
            f"model {spec!r}: cannot import {name} ({exc}); put its directory on PYTHONPATH "
            "or give a file, path/to/file.py:function"
        ) from None
    except Exception as exc:
        raise ValueError(
            f"model {spec!r}: importing {name} raised {type(exc).__name__}: {exc}"
        ) from None


def _load_file(spec: str, path: Path) -> ModuleType:
    if not path.is_file():
        raise ValueError(f"model {spec!r}: {path} is not a file")
    resolved = path.resolve()
    name = f"hpcdl_user_model_{hashlib.sha256(str(resolved).encode()).hexdigest()[:12]}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, resolved)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses and pickling look a module up by name
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise ValueError(
            f"model {spec!r}: loading {path} raised {type(exc).__name__}: {exc}"
        ) from None
    return module
