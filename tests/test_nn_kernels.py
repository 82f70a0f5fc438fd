"""hpcdl.nn.kernels: the seam for fast kernels, and hpcdl.nn.workspace's kept scratch arrays."""

import numpy as np
import pytest

from hpcdl import nn
from hpcdl.nn import kernels
from hpcdl.nn.kernels import conv as conv_kernels
from hpcdl.nn.workspace import Workspaces


class DoublingConv:
    """A stand-in kernel for 1x1 convolutions: y = 2 * the convolution, dx = 3 * dy (so its use
    shows)."""

    name = "doubling"

    def __init__(self, applies: bool):
        self.applies_to, self.calls = applies, []

    def applies(self, layer, x):
        return self.applies_to

    def forward(self, layer, x, train):
        self.calls.append("forward")
        return 2 * np.einsum("nhwc,cf->nhwf", x, layer.p["W"][0, 0])

    def backward(self, layer, dy):
        self.calls.append("backward")
        layer.g["W"][...] = 7.0
        return 3 * dy


@pytest.fixture
def seam_on(monkeypatch):
    monkeypatch.setattr(kernels, "_enabled", True)
    return monkeypatch


def conv_layer():
    model = nn.Model("one", [nn.Conv2d(2, 2, 1, bias=False)], (2, 4, 4), 32, seed=1)
    return model, model.body.layers[0]


def test_the_reference_runs_when_kernels_are_off_even_if_one_applies(monkeypatch):
    stand_in = DoublingConv(applies=True)
    monkeypatch.setattr(conv_kernels, "KERNELS", [stand_in])
    monkeypatch.setattr(kernels, "_enabled", False)
    _, layer = conv_layer()
    x = np.ones((1, 4, 4, 2), np.float32)
    layer.forward(x)
    assert stand_in.calls == [] and kernels.choose("conv", layer, x) is None


def test_a_kernel_that_applies_runs_forward_and_backward_and_reports_its_gradients(seam_on):
    stand_in = DoublingConv(applies=True)
    seam_on.setattr(conv_kernels, "KERNELS", [DoublingConv(applies=False), stand_in])
    _, layer = conv_layer()
    x = np.random.default_rng(0).standard_normal((1, 4, 4, 2)).astype(np.float32)
    reference = np.einsum("nhwc,cf->nhwf", x, layer.p["W"][0, 0])
    ready = []
    y = layer.forward(x)
    dx = layer.backward(np.ones_like(y), ready=ready.append)
    np.testing.assert_allclose(y, 2 * reference, rtol=1e-6)
    assert stand_in.calls == ["forward", "backward"]
    assert np.all(dx == 3.0) and np.all(layer.g["W"] == 7.0)
    assert ready == [layer.grad_end]  # the layer still tells the reducer its gradients are done


def test_no_kernel_that_applies_leaves_the_reference_bitwise(seam_on):
    seam_on.setattr(conv_kernels, "KERNELS", [DoublingConv(applies=False)])
    x = np.random.default_rng(1).standard_normal((2, 4, 4, 2)).astype(np.float32)
    on_model, on = conv_layer()
    y_on = on.forward(x)
    seam_on.setattr(kernels, "_enabled", False)
    _, off = conv_layer()
    np.testing.assert_array_equal(y_on, off.forward(x))
    assert on.seam.kernel is None


def test_every_family_has_a_module_and_a_misspelt_one_fails_early():
    for family in kernels.FAMILIES:
        assert isinstance(kernels.candidates(family), list)
    with pytest.raises(ValueError, match="unknown op family 'convolution'"):
        kernels.Seam("convolution")


def test_a_fallback_is_said_once(capsys):
    for _ in range(3):
        kernels.say_once("test-key-47", "cuDNN has no plan for conv 3x3 (1, 2, 3, 4): im2col")
    assert capsys.readouterr().err.count("cuDNN has no plan") == 1


def test_workspaces_keep_an_array_while_its_shape_dtype_and_backend_hold():
    work = Workspaces()
    a = work.get("cols", (4, 3), np.float32, np, fill=1)
    assert np.all(a == 1.0)
    a[...] = 5.0
    assert work.get("cols", (4, 3), np.float32, np, fill=1) is a  # fill only when allocated
    assert work.get("cols", (4, 4), np.float32, np) is not a
    assert work.get("cols", (4, 4), np.float64, np).dtype == np.float64
    assert work.last("cols").dtype == np.float64 and work.last("none") is None
    big = work.at_least("tiles", (8, 2), np.float32, np)
    small = work.at_least("tiles", (3, 2), np.float32, np)
    assert np.shares_memory(big, small) and small.shape == (3, 2)
