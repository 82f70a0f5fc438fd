"""The one name map per model: which PyTorch state-dict key holds which hpcdl array, and how.

Import (`--init-from`) and export (`python -m hpcdl.export`) are adapters over this map
(hpcdl.nn.weights_io, hpcdl.nn.onnx_export); no layer knows a file format.

Names (docs/models.md has the resnet18/50 table):
- resnet18, resnet50: torchvision's `resnet18`/`resnet50` keys. hpcdl's top-level layers
  [conv, bn, relu, maxpool, blocks..., avgpool, fc] become conv1, bn1, layer{1-4}.{i}, fc; a
  block's branch convolutions and norms are conv1, bn1, conv2, bn2 (conv3, bn3), its 1x1 + norm
  shortcut is downsample.0, downsample.1.
- every other model (mlp, cnn, resnet20, a user's): the hpcdl layer path without the class name
  ('3.branch.0.Conv2d' -> '3.branch.0'), i.e. the keys of a torch.nn.Sequential with the same
  layers in the same order (resnet20's blocks hold `branch` and `shortcut` sub-sequences).
Suffixes are PyTorch's: weight and bias (W, b; BatchNorm's gamma, beta), running_mean,
running_var and num_batches_tracked (a 0-d int64 that hpcdl does not use: written on export,
accepted on import).

Forms (hpcdl runs channels-last, PyTorch channels-first):
- conv: hpcdl (kh, kw, C_in, C_out) <-> PyTorch (C_out, C_in, kh, kw)
- dense: hpcdl (in, out) <-> PyTorch (out, in); after a Flatten of an (H, W, C) activation with
  H*W > 1, hpcdl's inputs are in (h, w, c) order and PyTorch's in (c, h, w): the rows are
  permuted too ("dense_hwc"), so the PyTorch model flattens its NCHW activation unchanged.
- vector: as is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from hpcdl.nn.blocks import ResidualBlock
from hpcdl.nn.conv import Conv2d
from hpcdl.nn.layers import Dropout, Flatten, Layer, Linear, ReLU
from hpcdl.nn.model import Model
from hpcdl.nn.norm import BatchNorm

TORCHVISION_RESNETS = {"resnet18": (2, 2, 2, 2), "resnet50": (3, 4, 6, 3)}
SUFFIX = {"W": "weight", "b": "bias", "gamma": "weight", "beta": "bias"}
COUNT = "num_batches_tracked"


@dataclass(frozen=True)
class WeightName:
    """One state-dict entry: its key, the hpcdl layer and array name, and the form (above)."""

    key: str
    leaf: Layer
    attr: str  # 'W', 'b', 'gamma', 'beta', 'running_mean', 'running_var', 'num_batches_tracked'
    form: str  # 'conv', 'dense', 'dense_hwc', 'vector', 'count'
    hwc: tuple[int, int, int] | None = None  # dense_hwc: the flattened (H, W, C)


def weight_names(model: Model) -> list[WeightName]:
    """The model's name map in forward order, weight before bias (PyTorch's state_dict order)."""
    flattened = _flatten_inputs(model)
    names = []
    for leaf, path in _leaf_paths(model.body):
        prefix = _prefix(model, path)
        for spec in sorted(leaf.param_specs, key=lambda s: SUFFIX[s.name] == "bias"):
            form, hwc = _form(leaf, spec.name, flattened.get(id(leaf)))
            names.append(WeightName(f"{prefix}.{SUFFIX[spec.name]}", leaf, spec.name, form, hwc))
        for buf_name, _, _ in leaf.buffer_specs:
            names.append(WeightName(f"{prefix}.{buf_name}", leaf, buf_name, "vector"))
        if isinstance(leaf, BatchNorm):
            names.append(WeightName(f"{prefix}.{COUNT}", leaf, COUNT, "count"))
    return names


def head_leaf(model: Model) -> Layer:
    """The final layer with parameters (the classifier that fine-tuning re-initialises)."""
    return next(leaf for leaf in model.body.leaves() if leaf.param_specs)


def to_torch(value: np.ndarray, name: WeightName) -> np.ndarray:
    """hpcdl's array (its own shape) -> PyTorch's layout, contiguous."""
    if name.form == "conv":
        value = value.transpose(3, 2, 0, 1)
    elif name.form == "dense":
        value = value.T
    elif name.form == "dense_hwc":
        h, w, c = name.hwc
        value = value.reshape(h, w, c, -1).transpose(3, 2, 0, 1).reshape(-1, h * w * c)
    return np.ascontiguousarray(value)


def from_torch(value: np.ndarray, name: WeightName) -> np.ndarray:
    """PyTorch's layout -> hpcdl's array shape (inverse of to_torch)."""
    if name.form == "conv":
        return value.transpose(2, 3, 1, 0)
    if name.form == "dense":
        return value.T
    if name.form == "dense_hwc":
        h, w, c = name.hwc
        return value.reshape(-1, c, h, w).transpose(2, 3, 1, 0).reshape(h * w * c, -1)
    return value


def _form(leaf: Layer, attr: str, hwc: tuple[int, int, int] | None) -> tuple[str, Any]:
    if isinstance(leaf, Conv2d) and attr == "W":
        return "conv", None
    if isinstance(leaf, Linear) and attr == "W":
        return ("dense_hwc", hwc) if hwc else ("dense", None)
    return "vector", None


def _leaf_paths(root: Layer) -> list[tuple[Layer, list[str]]]:
    """(leaf, path of child keys) for every leaf with parameters or buffers, in forward order."""
    found: list[tuple[Layer, list[str]]] = []

    def walk(layer: Layer, path: list[str]) -> None:
        children = layer.named_children()
        if not children and (layer.param_specs or layer.buffer_specs):
            found.append((layer, path))
        for key, child in children:
            walk(child, [*path, key])

    walk(root, [])
    return found


def _prefix(model: Model, path: list[str]) -> str:
    if model.name in TORCHVISION_RESNETS:
        return _torchvision_prefix(model, path)
    return ".".join(path)


def _torchvision_prefix(model: Model, path: list[str]) -> str:
    """hpcdl's path in an ImageNet ResNet (hpcdl.nn.models) -> torchvision's module name."""
    layers = model.body.layers
    top = int(path[0])
    if top == 0:
        return "conv1"
    if top == 1:
        return "bn1"
    if top == len(layers) - 1:
        return "fc"
    block_index = top - 4  # after conv, bn, relu, maxpool
    stage, i = 0, block_index
    for depth in TORCHVISION_RESNETS[model.name]:
        if i < depth:
            break
        stage, i = stage + 1, i - depth
    block = layers[top]
    assert isinstance(block, ResidualBlock), path
    part, index = path[1], int(path[2])
    if part == "shortcut":
        return f"layer{stage + 1}.{i}.downsample.{index}"
    earlier = block.branch.layers[:index]
    kind = type(block.branch.layers[index])
    number = sum(1 for layer in earlier if isinstance(layer, kind)) + 1
    return f"layer{stage + 1}.{i}.{'conv' if kind is Conv2d else 'bn'}{number}"


def _flatten_inputs(model: Model) -> dict[int, tuple[int, int, int]]:
    """{id(Linear): (H, W, C)} for each Linear fed by a Flatten of a spatial (H*W > 1)
    activation, possibly through Dropout/ReLU. Found with one zero sample forward in eval mode
    (which changes no state: hpcdl.nn.summary), only when the model has a Flatten."""
    order = list(reversed(list(model.body.leaves())))  # forward order
    if not any(isinstance(leaf, Flatten) for leaf in order):
        return {}
    from hpcdl.nn.summary import layer_rows  # noqa: PLC0415 (avoids an import cycle)

    layer_rows(model)  # every Flatten records its input shape (N, H, W, C)
    found: dict[int, tuple[int, int, int]] = {}
    source = None
    for leaf in order:
        if isinstance(leaf, Flatten):
            shape = tuple(int(d) for d in leaf.shape)
            source = shape[1:] if len(shape) == 4 and shape[1] * shape[2] > 1 else None
        elif isinstance(leaf, Linear) and source is not None:
            found[id(leaf)] = source
            source = None
        elif not isinstance(leaf, (Dropout, ReLU)):
            source = None
    return found
