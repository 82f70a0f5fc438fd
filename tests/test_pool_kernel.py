"""hpcdl.nn.kernels.pool: CupyMaxPool's backward loop (gather_backward, its NumPy twin) is
MaxPool2d.backward bit for bit, tied maxima shared as the reference shares them; marked gpu:
the CuPy kernels themselves against the reference."""

import numpy as np
import pytest

from hpcdl.backend import cupy_or_none, gpu_available
from hpcdl.nn import kernels
from hpcdl.nn.kernels.pool import CupyMaxPool, gather_backward, geometry
from hpcdl.nn.layers import MaxPool2d

SHAPES = [  # (kernel, stride, padding, H, W): tiled, tiled with a leftover row, overlapping
    (2, 2, 0, 6, 6),
    (2, 2, 0, 7, 5),
    (3, 2, 1, 7, 8),
    (3, 1, 0, 5, 5),
    (3, 2, 0, 9, 9),
]


def relu_input(h, w, seed=0):
    """After a ReLU of a shifted normal: most values are 0, so tied zeros are common."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((2, h, w, 3)) - 0.8).astype(np.float32)
    return np.maximum(x, 0, out=x)


def ties_of(x, y, layer):
    """How many elements of each window equal its maximum (in float32, as the kernel counts)."""
    h_in, w_in, _, ho, wo, kh, kw, sh, sw, ph, pw = geometry(layer, x.shape)
    ties = np.zeros_like(y)
    for oh in range(ho):
        for ow in range(wo):
            for a in range(kh):
                for b in range(kw):
                    h, w = oh * sh - ph + a, ow * sw - pw + b
                    if 0 <= h < h_in and 0 <= w < w_in:
                        ties[:, oh, ow] += x[:, h, w] == y[:, oh, ow]
    return ties


@pytest.mark.parametrize(("k", "s", "p", "h", "w"), SHAPES)
def test_the_backward_kernels_loop_is_the_reference_bitwise(k, s, p, h, w):
    layer = MaxPool2d(k, s, p)
    x = relu_input(h, w)
    y = layer.forward(x)
    dy = np.random.default_rng(1).standard_normal(y.shape).astype(np.float32)
    ties = ties_of(x, y, layer)
    assert (ties > 1).any()  # shared maxima are exercised
    expected = layer.backward(dy)
    got = gather_backward(x, y, ties, dy, layer.tiled, geometry(layer, x.shape))
    np.testing.assert_array_equal(got, expected)
    assert (np.signbit(got) == np.signbit(expected)).all()  # zeros' signs too


def test_on_the_cpu_the_seam_keeps_the_reference(monkeypatch):
    monkeypatch.setattr(kernels, "_enabled", True)
    layer = MaxPool2d(2)
    x = relu_input(4, 4)
    assert not CupyMaxPool().applies(layer, x)
    layer.forward(x)
    assert layer.seam.kernel is None


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a GPU")
@pytest.mark.parametrize(("k", "s", "p", "h", "w"), SHAPES)
def test_the_cupy_kernels_are_the_reference_bitwise_on_the_gpu(monkeypatch, k, s, p, h, w):
    cp = cupy_or_none()
    x = cp.asarray(relu_input(h, w))
    dy = None
    results = []
    for on in (True, False):
        monkeypatch.setattr(kernels, "_enabled", on)
        layer = MaxPool2d(k, s, p)
        y = layer.forward(x)
        assert (layer.seam.kernel is not None) == on
        if dy is None:
            dy = cp.asarray(np.random.default_rng(1).standard_normal(y.shape), cp.float32)
        results.append((cp.asnumpy(y), cp.asnumpy(layer.backward(dy))))
    for got, expected in zip(results[0], results[1]):
        np.testing.assert_array_equal(got, expected)
