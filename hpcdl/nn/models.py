"""The model zoo: `build_model(name, input_shape, num_classes, ...)` for mlp, cnn, resnet20,
resnet18 and resnet50, or a user's builder named `package.module:function` / `file.py:function`
(hpcdl.nn.user_models).

Each model initialises as its reference does (docs/nn.md): cnn and mlp as Keras (Glorot-uniform
kernels, zero biases), the ResNets as torchvision's (Kaiming-normal fan_out convolutions,
BatchNorm 1 and 0, nn.Linear's default classifier).

resnet18 and resnet50 are torchvision's ImageNet networks: 7x7 stride-2 stem, 3x3 stride-2 max
pool (padding 1), four stages of basic (resnet18: 2, 2, 2, 2) or bottleneck (resnet50: 3, 4, 6,
3) blocks of 64, 128, 256, 512 channels (x4 for bottlenecks), stride 2 on the first block of
stages 2-4, projection shortcuts, global average pool, dense classifier. With 1000 classes they
have torchvision's 11,689,512 and 25,557,032 parameters. Any input size >= 1x1 works (the
spatial size is 1 after stage 4 from 32x32 down).

cnn is the Keras cifar10_cnn example. On small inputs it adapts so that no spatial size
vanishes: a 'valid' 3x3 convolution gets padding 1 along a dimension smaller than 3, and a 2x2
max pool pools only along dimensions of size >= 2 (and is left out when neither is). On 32x32
this is exactly the Keras network; on 8x8 (digits) it is 8 -> 8 -> 6 -> pool 3 -> 3 -> 1 ->
(no pool) 1, giving 64 features before the dense layers.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from hpcdl.nn.blocks import BottleneckBlock, ResidualBlock, conv_bn
from hpcdl.nn.conv import Conv2d
from hpcdl.nn.layers import Dropout, Flatten, GlobalAvgPool, Layer, Linear, MaxPool2d, ReLU
from hpcdl.nn.model import Model
from hpcdl.nn.user_models import build_user_model, is_user_model

MODELS = ("mlp", "cnn", "resnet20", "resnet18", "resnet50")


def build_model(
    name: str,
    input_shape: tuple[int, int, int],
    num_classes: int,
    seed: int = 0,
    xp: ModuleType = np,
    dtype: Any = np.float32,
) -> Model:
    """Build a model by name; parameters initialised deterministically from seed on xp.

    A name 'package.module:function' or 'file.py:function' calls a user's builder
    (hpcdl.nn.user_models)."""
    if name not in MODELS and not is_user_model(name):
        raise ValueError(
            f"unknown model {name!r}; choose one of {', '.join(MODELS)}, "
            "or name your own as package.module:function or file.py:function"
        )
    shape = tuple(input_shape)
    if len(shape) != 3 or not all(isinstance(d, (int, np.integer)) and d >= 1 for d in shape):
        raise ValueError(
            f"model {name!r} needs input_shape (C, H, W) of three positive integers, "
            f"got {input_shape!r}"
        )
    if not isinstance(num_classes, (int, np.integer)) or num_classes < 2:
        raise ValueError(f"model {name!r} needs num_classes >= 2, got {num_classes!r}")
    c, h, w = (int(d) for d in shape)
    if is_user_model(name):
        return build_user_model(name, (c, h, w), int(num_classes), seed=seed, xp=xp, dtype=dtype)
    builders = {
        "mlp": _mlp,
        "cnn": _cnn,
        "resnet20": _resnet20,
        "resnet18": _resnet18,
        "resnet50": _resnet50,
    }
    layers = builders[name](c, h, w, int(num_classes))
    return Model(name, layers, (c, h, w), int(num_classes), seed=seed, xp=xp, dtype=dtype)


def _keras_dense(n_in: int, n_out: int) -> Linear:
    return Linear(n_in, n_out, init="glorot_uniform", bias_init="zeros")


def _keras_conv(c_in: int, c_out: int, padding: int | tuple[int, int]) -> Conv2d:
    return Conv2d(c_in, c_out, 3, padding=padding, init="glorot_uniform", bias_init="zeros")


def _mlp(c: int, h: int, w: int, k: int) -> list[Layer]:
    """flatten -> dense 512 -> relu -> dropout 0.2 -> dense k; Keras Dense initialisation."""
    return [Flatten(), _keras_dense(c * h * w, 512), ReLU(), Dropout(0.2), _keras_dense(512, k)]


def _cnn(c: int, h: int, w: int, k: int) -> list[Layer]:
    """Keras cifar10_cnn: 2 x [conv same, conv valid, pool 2, dropout .25], dense 512, dense k."""
    layers: list[Layer] = []
    for filters in (32, 64):
        layers += [_keras_conv(c, filters, 1), ReLU()]
        pad = (int(h < 3), int(w < 3))
        layers += [_keras_conv(filters, filters, pad), ReLU()]
        h, w = h + 2 * pad[0] - 2, w + 2 * pad[1] - 2
        pool = (min(2, h), min(2, w))
        if pool != (1, 1):
            layers.append(MaxPool2d(pool))
            h, w = h // pool[0], w // pool[1]
        layers.append(Dropout(0.25))
        c = filters
    return layers + [
        Flatten(),
        _keras_dense(c * h * w, 512),
        ReLU(),
        Dropout(0.5),
        _keras_dense(512, k),
    ]


def _resnet20(c: int, h: int, w: int, k: int) -> list[Layer]:
    """CIFAR ResNet-20 (He et al. 2016): 3 stages x 3 basic blocks, 16/32/64 channels, option A."""
    layers: list[Layer] = [*conv_bn(c, 16, 1), ReLU()]
    c_in = 16
    for stage, width in enumerate((16, 32, 64)):
        for block in range(3):
            stride = 2 if stage > 0 and block == 0 else 1
            layers.append(ResidualBlock(c_in, width, stride, shortcut="A"))
            c_in = width
    return layers + [GlobalAvgPool(), Linear(64, k)]  # torchvision keeps nn.Linear's default


def _imagenet_resnet(c: int, k: int, bottleneck: bool, depths: tuple[int, ...]) -> list[Layer]:
    """torchvision's ImageNet ResNet: stem, 4 stages of blocks, global average pool, dense k."""
    layers: list[Layer] = [*conv_bn(c, 64, 2, kernel=7), ReLU(), MaxPool2d(3, 2, padding=1)]
    c_in = 64
    for stage, (width, depth) in enumerate(zip((64, 128, 256, 512), depths)):
        for block in range(depth):
            stride = 2 if stage > 0 and block == 0 else 1
            if bottleneck:
                layers.append(BottleneckBlock(c_in, width, stride))
                c_in = width * BottleneckBlock.expansion
            else:
                layers.append(ResidualBlock(c_in, width, stride, shortcut="B"))
                c_in = width
    return layers + [GlobalAvgPool(), Linear(c_in, k)]  # nn.Linear's default initialisation


def _resnet18(c: int, h: int, w: int, k: int) -> list[Layer]:
    return _imagenet_resnet(c, k, bottleneck=False, depths=(2, 2, 2, 2))


def _resnet50(c: int, h: int, w: int, k: int) -> list[Layer]:
    return _imagenet_resnet(c, k, bottleneck=True, depths=(3, 4, 6, 3))
