"""Users' own models: `--model package.module:function` or `--model path/to/file.py:function`.

The contract (docs/models.md): `function(input_shape, num_classes)` returns a list of
hpcdl.nn layers, or an `hpcdl.nn.Model` built for exactly that shape and class count.
`input_shape` is the (C, H, W) the loader yields. The builder is also given `seed=`, `xp=` and
`dtype=` (build_model's arguments) when its signature takes them; a builder that returns a
Model must take them and pass them on, or the model would ignore --seed and --device. A list
is wrapped here into a Model initialised from seed exactly as the built-in models are. Every
rank calls the builder; the layouts must agree (startup checks) and rank 0's values are
broadcast, so the builder should be deterministic in seed.

Before it is used, the model runs one zero sample forward (hpcdl.nn.summary.layer_rows): a
layer that cannot take its input, or logits that are not (num_classes,) per sample, is one
error at start-up rather than a traceback at the first step.

A module is imported with importlib (so it must be on sys.path: the current directory is, for
`python -m`); a file path (ending in .py, relative to the current directory) is loaded under a
private module name. Every failure is a ValueError of one sentence naming the spec and the fix.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from hpcdl.backend import array_module
from hpcdl.nn.layers import Layer
from hpcdl.nn.model import Model
from hpcdl.nn.summary import error_line, layer_rows

CONTRACT = (
    "function(input_shape, num_classes) returning a list of hpcdl.nn layers or an hpcdl.nn.Model"
)
MODEL_KEYWORDS = ("seed", "xp", "dtype")
TORCHVISION = "torchvision:"  # `--model torchvision:NAME`: hpcdl's torch engine builds it


def is_user_model(name: str) -> bool:
    """True for 'module:function' and 'file.py:function' specs (built-in names have no colon)."""
    return ":" in name and not is_torchvision(name)


def is_torchvision(name: str) -> bool:
    """True for 'torchvision:NAME': a torchvision.models builder (hpcdl.torch_engine)."""
    return name.startswith(TORCHVISION)


def load_builder(spec: str) -> Callable[..., Any]:
    """The callable a 'package.module:function' or 'file.py:function' spec names."""
    where, attr = _split(spec)
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
    """Call the builder spec names, wrap a list of layers into a Model, check the result."""
    built = call_builder(spec, input_shape, num_classes, seed=seed, xp=xp, dtype=dtype)
    return as_model(spec, built, input_shape, num_classes, seed=seed, xp=xp, dtype=dtype)


def call_builder(
    spec: str,
    input_shape: tuple[int, int, int],
    num_classes: int,
    seed: int = 0,
    xp: ModuleType = np,
    dtype: Any = np.float32,
) -> Any:
    """What the builder spec names returns for (input_shape, num_classes), unchecked: an hpcdl
    model (as_model), or a torch.nn.Module (is_torch_module) for hpcdl's torch engine."""
    builder = load_builder(spec)
    offered = {"seed": seed, "xp": xp, "dtype": dtype}
    taken = _keywords_taken(builder)
    try:
        return builder(
            tuple(input_shape), num_classes, **{k: v for k, v in offered.items() if k in taken}
        )
    except Exception as exc:  # the user's code: report it in one line, whatever it raised
        raise ValueError(f"model {spec!r}: the builder raised {error_line(exc)}") from None


def is_torch_module(built: Any) -> bool:
    """built is a torch.nn.Module, told by its type without importing torch."""
    return any(
        (cls.__module__, cls.__name__) == ("torch.nn.modules.module", "Module")
        for cls in type(built).__mro__
    )


def as_model(
    spec: str,
    built: Any,
    input_shape: tuple[int, int, int],
    num_classes: int,
    seed: int = 0,
    xp: ModuleType = np,
    dtype: Any = np.float32,
) -> Model:
    """The Model a builder's result is: a list of layers wrapped, a Model checked."""
    shape = tuple(input_shape)
    if isinstance(built, (list, tuple)):
        _check_layers(spec, built)
        model = Model(
            model_name(spec), list(built), shape, num_classes, seed=seed, xp=xp, dtype=dtype
        )
    elif isinstance(built, Model):
        taken = _keywords_taken(load_builder(spec))
        _check_model(spec, built, taken, shape, num_classes, xp, dtype)
        model = built
    else:
        raise ValueError(
            f"model {spec!r}: the builder returned a {type(built).__name__}; it must be a "
            f"{CONTRACT}, or a torch.nn.Module"
        )
    _check_output(spec, model)
    return model


def model_name(spec: str) -> str:
    """The name a list-returning builder's Model gets (checkpoints record it): 'module:function'
    whether the spec names a module or a file, so a resume from elsewhere finds it the same."""
    where, attr = _split(spec)
    return f"{Path(where).stem if where.endswith('.py') else where}:{attr}"


def _split(spec: str) -> tuple[str, str]:
    where, _, attr = spec.rpartition(":")
    if not where or not attr.isidentifier():
        raise ValueError(
            f"model {spec!r}: expected package.module:function or path/to/file.py:function"
        )
    return where, attr


def _keywords_taken(builder: Callable[..., Any]) -> set[str]:
    """Which of seed, xp, dtype the builder's signature accepts (all of them for **kwargs)."""
    try:
        params = inspect.signature(builder).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a C callable): offer everything
        return set(MODEL_KEYWORDS)
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return set(MODEL_KEYWORDS)
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return named & set(MODEL_KEYWORDS)


def _check_layers(spec: str, layers: list | tuple) -> None:
    if not layers:
        raise ValueError(f"model {spec!r}: the builder returned an empty list; give its layers")
    for i, layer in enumerate(layers):
        if not isinstance(layer, Layer):
            raise ValueError(
                f"model {spec!r}: item {i} of the list the builder returned is a "
                f"{type(layer).__name__}, not an hpcdl.nn layer"
            )


def _check_model(
    spec: str,
    model: Model,
    taken: set[str],
    shape: tuple[int, ...],
    num_classes: int,
    xp: ModuleType,
    dtype: Any,
) -> None:
    """A Model the builder made itself: built from the arguments it was given."""
    if taken != set(MODEL_KEYWORDS):
        missing = ", ".join(f"{k}=" for k in MODEL_KEYWORDS if k not in taken)
        raise ValueError(
            f"model {spec!r}: the builder returns an hpcdl.nn.Model but does not take {missing}; "
            "take seed=, xp=, dtype= and pass them to nn.Model, or return the list of layers"
        )
    if model.input_shape != shape or model.num_classes != num_classes:
        raise ValueError(
            f"model {spec!r}: the builder returned a model for input {model.input_shape} and "
            f"{model.num_classes} classes, asked for {shape} and {num_classes}; "
            "build it from the arguments it is given"
        )
    if model.dtype != np.dtype(dtype) or array_module(model.params) is not xp:
        raise ValueError(
            f"model {spec!r}: the builder returned a {model.dtype} model on "
            f"{array_module(model.params).__name__}, asked for {np.dtype(dtype)} on "
            f"{xp.__name__}; pass its xp= and dtype= to nn.Model"
        )


def _check_output(spec: str, model: Model) -> None:
    """One zero sample forward: every layer takes its input, the logits are (num_classes,)."""
    try:
        rows = layer_rows(model)
    except ValueError as exc:
        raise ValueError(
            f"model {spec!r}: for input {model.input_shape}, {exc}; size the layers from the "
            "input_shape the builder is given"
        ) from None
    last = rows[-1]
    if last.output_shape != (model.num_classes,):
        raise ValueError(
            f"model {spec!r}: for input {model.input_shape} the last layer, {last.name}, "
            f"gives {last.output_shape} per sample, not ({model.num_classes},) logits; end "
            "the model with a layer of num_classes outputs, e.g. nn.Linear(features, num_classes)"
        )


def _import(spec: str, name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise ValueError(
            f"model {spec!r}: cannot import {name} ({exc}); put its directory on PYTHONPATH "
            "or give a file, path/to/file.py:function"
        ) from None
    except Exception as exc:
        raise ValueError(f"model {spec!r}: importing {name} raised {error_line(exc)}") from None


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
        if isinstance(exc, ModuleNotFoundError) and exc.name == "torch":
            raise ValueError(
                f"model {spec!r}: {path} imports torch, which is not installed: "
                "pip install 'hpcdl[torch]'"
            ) from None
        raise ValueError(f"model {spec!r}: loading {path} raised {error_line(exc)}") from None
    return module
