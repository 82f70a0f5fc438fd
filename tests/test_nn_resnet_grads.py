"""ResNet-50's pieces against central finite differences in float64: the ImageNet stem and the
bottleneck block (projection + stride 2, identity), every input and every parameter entry.

Narrow channel counts keep the shapes small; the structure is the one nn.build_model uses."""

from __future__ import annotations

import numpy as np
import pytest
from gradcheck import check_layer

from hpcdl import nn
from hpcdl.nn.blocks import conv_bn


def imagenet_stem(c_in: int, width: int) -> nn.Sequential:
    """7x7 stride-2 convolution (no bias) + BatchNorm + ReLU + 3x3 stride-2 max pool."""
    return nn.Sequential([*conv_bn(c_in, width, 2, kernel=7), nn.ReLU(), nn.MaxPool2d(3, 2, 1)])


def describe(layer) -> tuple:
    """What makes two stem layers the same: kind, and kernel/stride/padding/bias or channels."""
    if isinstance(layer, nn.Conv2d):
        return ("conv", layer.kh, layer.kw, layer.sh, layer.sw, layer.ph, layer.pw, layer.has_bias)
    if isinstance(layer, nn.MaxPool2d):
        return ("maxpool", layer.kh, layer.kw, layer.sh, layer.sw, layer.ph, layer.pw)
    return (type(layer).__name__,)


def test_the_checked_stem_is_the_one_resnet50_builds():
    model = nn.build_model("resnet50", (3, 32, 32), 4, seed=0)
    built = model.body.layers[:4]
    assert [describe(layer) for layer in built] == [
        describe(layer) for layer in imagenet_stem(3, 64).layers
    ]
    assert (built[0].c_in, built[0].c_out) == (3, 64)
    assert isinstance(model.body.layers[4], nn.BottleneckBlock)


@pytest.mark.parametrize("hw", [(16, 16), (15, 13)], ids=["even", "odd_non_square"])
def test_imagenet_stem_gradients(xp, hw):
    """Input (2, H, W, 3): conv 8x8 (even) or 8x7, max pool 4x4 or 4x4; 596 parameters."""
    stem = imagenet_stem(3, 4)
    y = check_layer(stem, (2, *hw, 3), xp, params_checked=7 * 7 * 3 * 4 + 2 * 4)
    assert y.shape == (2, 4, 4, 4)


@pytest.mark.parametrize(
    "c_in,width,stride,projection",
    [(8, 4, 2, True), (16, 4, 1, False)],
    ids=["projection_stride2", "identity"],
)
def test_bottleneck_block_gradients_everywhere(xp, c_in, width, stride, projection):
    """Every parameter entry (a sample could miss a whole array), and the input gradient."""
    block = nn.BottleneckBlock(c_in, width, stride)
    assert len(block.shortcut.layers) == (2 if projection else 0)
    params = sum(int(np.prod(s.shape)) for leaf in block.leaves() for s in leaf.param_specs)
    y = check_layer(block, (2, 6, 6, c_in), xp, params_checked=params)
    assert y.shape == (2, 6 // stride, 6 // stride, 4 * width)


def test_stem_and_bottlenecks_through_the_loss_as_one_model():
    """The flat buffers and the back-to-front layout of a small ResNet-50-shaped model: every
    parameter array's gradient of the cross-entropy, a few entries per array."""
    layers = [
        *imagenet_stem(3, 8).layers,
        nn.BottleneckBlock(8, 4, 1),  # projection, stride 1 (stage 1's first block)
        nn.BottleneckBlock(16, 4, 2),  # projection, stride 2
        nn.BottleneckBlock(16, 4, 1),  # identity
        nn.GlobalAvgPool(),
        nn.Linear(16, 3),
    ]
    model = nn.Model("resnet50_slice", layers, (3, 16, 16), 3, seed=2, dtype=np.float64)
    rng = np.random.default_rng(3)
    x, y = rng.standard_normal((3, 3, 16, 16)), rng.integers(0, 3, 3)

    def loss() -> float:
        return float(nn.softmax_cross_entropy(model.forward(x, train=True), y)[0])

    _, dlogits = nn.softmax_cross_entropy(model.forward(x, train=True), y)
    model.backward(dlogits)
    analytic = model.grads.copy()
    idx = np.concatenate(
        [
            off + rng.choice(int(np.prod(s)), min(3, int(np.prod(s))), replace=False)
            for _, s, off in model.layout()
        ]
    )
    numeric = []
    for i in idx:
        old = float(model.params[i])
        model.params[i] = old + 1e-6
        plus = loss()
        model.params[i] = old - 1e-6
        minus = loss()
        model.params[i] = old
        numeric.append((plus - minus) / 2e-6)
    numeric = np.array(numeric)
    err = np.linalg.norm(analytic[idx] - numeric) / np.linalg.norm(numeric)
    assert err < 1e-6, f"relative gradient error {err:.2e}"
    assert len(model.layout()) == 3 + 3 * 9 + 2 * 3 + 2  # stem, 3 branches, 2 projections, dense
