"""What the torch engine is asked to train: flags it refuses, torchvision names, --init-from."""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import torch

from hpcdl import resume
from hpcdl.comm.world import World
from hpcdl.config import TrainConfig
from hpcdl.nn.user_models import TORCHVISION


def seed_all(seed: int) -> None:
    """torch's generator from --seed, before a builder makes the module (its initialisation)."""
    torch.manual_seed(seed)


def refused(cfg: TrainConfig) -> str | None:
    """The one line for the first flag the torch engine does not serve yet, else None."""
    unsupported = [
        (cfg.gpu_kernels, "--gpu-kernels"),
        (cfg.nesterov and not cfg.momentum, "--nesterov with --momentum 0"),
    ]  # fmt: skip
    for asked, flag in unsupported:
        if asked:
            return (
                f"{flag} is not supported with a torch model (--model {cfg.model}) yet; "
                "leave it out, or train the model with a script and hpcdl.torch (docs/torch.md)"
            )
    return None


def torchvision_model(cfg: TrainConfig, num_classes: int) -> Any:
    """torchvision.models' image classifier NAME of `--model torchvision:NAME`, for
    num_classes, with fresh weights (never downloaded); ValueError of one line for a name
    torchvision lacks or one of its other kinds of model (detection, segmentation, video,
    optical flow, quantized)."""
    name = cfg.model[len(TORCHVISION) :]
    try:
        import torchvision  # noqa: PLC0415
    except ImportError:
        raise ValueError(
            f"--model {cfg.model} needs torchvision, which is not installed: pip install "
            "torchvision (the build that matches your torch)"
        ) from None
    models = torchvision.models
    if name not in models.list_models():
        raise ValueError(
            f"--model {cfg.model}: torchvision.models has no model {name!r}; see "
            "torchvision.models.list_models(module=torchvision.models)"
        )
    if name not in models.list_models(module=models):  # detection, segmentation, video, ...
        raise ValueError(
            f"--model {cfg.model} is not an image classifier; hpcdl.train trains those of "
            "torchvision.models.list_models(module=torchvision.models), or train it with your "
            "own script and hpcdl.torch (docs/torch.md)"
        )
    builder = models.get_model_builder(name)
    # nothing is downloaded: no weights (--init-from gives them), no backbone's either
    extra = {"weights_backbone": None} if "weights_backbone" in _parameters(builder) else {}
    return builder(weights=None, num_classes=num_classes, **extra)


def _parameters(builder: Any) -> set[str]:
    return set(inspect.signature(builder).parameters)


def init_from(cfg: TrainConfig, world: World, model: Any) -> None:
    """--init-from for a torch module (hpcdl.resume.init_from): every key and shape must fit
    but the final Linear layer's class count (load_state_dict); build() then broadcasts it.
    Collective."""
    resume.init_from(cfg, world, lambda state: load_state_dict(model.module, state, cfg.init_from))


def load_state_dict(module: Any, state: dict[str, np.ndarray], source: str) -> list[str]:
    """Copy state into module in place; ValueError naming the keys or shapes that do not fit.
    The final Linear layer of another class count (a fine-tune) keeps its fresh values, and
    the returned line says so, as for hpcdl's models."""
    own = module.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    wrong = [k for k in own if k in state and tuple(state[k].shape) != tuple(own[k].shape)]
    head = _head_keys(module)
    fresh = [k for k in wrong if k in head and state[k].shape[1:] == tuple(own[k].shape[1:])]
    wrong = [k for k in wrong if k not in fresh]
    if missing or unexpected or wrong:
        parts = [
            f"missing {_some(missing)}" if missing else "",
            f"unexpected {_some(unexpected)}" if unexpected else "",
            ", ".join(f"{k} is {tuple(state[k].shape)} in the file, {tuple(own[k].shape)} in the "
                      "model" for k in wrong[:3]),
            _not_a_linear_head(module, wrong),
        ]  # fmt: skip
        raise ValueError(
            f"--init-from {source} does not fit --model's state dict: "
            f"{'; '.join(p for p in parts if p)}; give the weights of this model"
        )
    for key in own:
        value = np.asarray(state[key])
        if key not in fresh and value.dtype.kind == "f" and not np.isfinite(value).all():
            raise ValueError(
                f"--init-from {source}: {key} holds NaN or infinite values; give finite "
                "weights (those of a run before it diverged)"
            )
    with torch.no_grad():
        for key, tensor in own.items():
            if key not in fresh:
                tensor.copy_(torch.from_numpy(np.asarray(state[key])).to(tensor.dtype))
    if not fresh:
        return []
    key = fresh[0]
    return [
        f"{source}: {key} is {tuple(state[key].shape)} there, {tuple(own[key].shape)} here: the "
        f"final layer is re-initialised for {own[key].shape[0]} classes"
    ]


def _head_keys(module: Any) -> set[str]:
    """The state-dict keys of the module's last Linear layer (its classifier)."""
    linears = [name for name, m in module.named_modules() if isinstance(m, torch.nn.Linear)]
    if not linears:
        return set()
    prefix = f"{linears[-1]}." if linears[-1] else ""
    return {f"{prefix}weight", f"{prefix}bias"}


def _not_a_linear_head(module: Any, keys: list[str]) -> str:
    """The reason a class-count change in the last layer with parameters is not re-initialised
    there (a Conv2d head, as squeezenet's), if keys reach into that layer; else ''."""
    last = [name for name, m in module.named_modules() if list(m.parameters(recurse=False))][-1:]
    head = [k for k in keys if last and k.rpartition(".")[0] == last[0]]
    if not head or isinstance(module.get_submodule(last[0]), torch.nn.Linear):
        return ""
    kind = type(module.get_submodule(last[0])).__name__
    return (
        f"{last[0] or 'the module'} is a {kind}: only a final nn.Linear of another class count "
        "is re-initialised"
    )


def _some(keys: list[str]) -> str:
    more = f" (+{len(keys) - 3} more)" if len(keys) > 3 else ""
    return ", ".join(keys[:3]) + more
