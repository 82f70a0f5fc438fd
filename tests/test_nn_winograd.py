"""Conv2d's Winograd F(2x2, 3x3) path (hpcdl.nn.winograd), chunked NumPy path only.

Float64 against the whole-batch im2col path (1e-12) and finite differences, with the channel
threshold lowered so that these small layers take the Winograd path, and chunks shrunk so that
batches split into several chunks, the last one partial."""

from __future__ import annotations

import numpy as np
import pytest
from gradcheck import assert_same_step, check_layer, conv_step

from hpcdl import backend
from hpcdl.nn import Conv2d, ReLU, Sequential, conv_winograd, winograd
from hpcdl.nn.model import bind_flat

CASES = [
    # (c_in, c_out, padding, bias, (N, H, W))
    (3, 3, 1, True, (5, 6, 6)),  # even output: whole tiles
    (3, 5, 1, True, (5, 7, 5)),  # odd output: one more tile row and column, cropped
    (4, 2, 0, False, (3, 9, 8)),  # valid, odd H out; no bias
    (2, 3, 0, True, (1, 6, 7)),  # batch 1: one chunk
]


@pytest.fixture
def winograd_everywhere(monkeypatch):
    """One BLAS thread, the Winograd path for any channel count and chunk threads; chunk_of
    sets the images per chunk."""
    before = backend.blas_threads()
    backend.set_blas_threads(1)
    monkeypatch.setattr(conv_winograd, "WINOGRAD_MIN_CHANNELS", 1)
    monkeypatch.setattr(conv_winograd, "WINOGRAD_THREADED_MIN_CHANNELS", 1)
    monkeypatch.setattr(conv_winograd, "WINOGRAD_THREADED_MIN_SIZE", 1)

    def chunk_of(layer, x_shape, images):
        n, h, w, _ = x_shape
        th, tw = winograd.tiles(*layer.output_hw(h, w))
        image_bytes = 16 * th * tw * max(layer.c_in, layer.c_out) * 8
        monkeypatch.setattr(conv_winograd, "WINOGRAD_CHUNK_BYTES", images * image_bytes)

    yield chunk_of
    backend.set_blas_threads(before)
    backend.set_compute_threads(1)


def _step(layer, x, dy, blas_threads):
    """(whether forward took Winograd, y, dx, gradients)."""
    return conv_step(layer, x, dy, blas_threads, seen="winograd")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("c_in,c_out,padding,bias,nhw", CASES)
def test_winograd_equals_im2col(winograd_everywhere, threads, c_in, c_out, padding, bias, nhw):
    layer = Conv2d(c_in, c_out, 3, padding=padding, bias=bias)
    winograd_everywhere(layer, (*nhw, c_in), images=2)
    bind_flat(layer, np, np.float64, seed=1)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((*nhw, c_in))
    dy = rng.standard_normal(layer.forward(x).shape)
    backend.set_compute_threads(threads)
    used, y, dx, grads = _step(layer, x, dy, blas_threads=1)
    assert used and layer.chunk == min(2, nhw[0])
    used0, y0, dx0, grads0 = _step(layer, x, dy, blas_threads=None)
    assert not used0
    scale = max(np.abs(y0).max(), np.abs(dx0).max())
    np.testing.assert_allclose(y, y0, rtol=1e-12, atol=1e-12 * scale)
    np.testing.assert_allclose(dx, dx0, rtol=1e-12, atol=1e-12 * scale)
    assert sorted(grads) == (["W", "b"] if bias else ["W"])
    for name in grads0:
        np.testing.assert_allclose(grads[name], grads0[name], rtol=1e-12, atol=1e-12 * scale)


@pytest.mark.parametrize("c_in,c_out,padding,bias,nhw", CASES[:3])
def test_winograd_gradients_match_finite_differences(
    winograd_everywhere, c_in, c_out, padding, bias, nhw
):
    layer = Conv2d(c_in, c_out, 3, padding=padding, bias=bias)
    small = (2, *nhw[1:], c_in)
    winograd_everywhere(layer, small, images=1)
    check_layer(layer, small, np)
    assert layer.winograd and layer.chunk == 1


def test_winograd_forward_is_the_same_on_any_thread_count(winograd_everywhere):
    layer = Conv2d(3, 4, 3, padding=1)
    winograd_everywhere(layer, (7, 6, 5, 3), images=2)
    bind_flat(layer, np, np.float32, seed=2)
    x = np.random.default_rng(3).standard_normal((7, 6, 5, 3)).astype(np.float32)
    outputs = []
    for threads in (1, 2, 1):
        backend.set_compute_threads(threads)
        outputs.append(layer.forward(x).copy())
        assert layer.winograd
    assert all(np.array_equal(outputs[0], other) for other in outputs[1:])


@pytest.mark.parametrize("threads", [1, 2])
def test_winograd_step_repeats_bitwise(winograd_everywhere, threads):
    layer = Conv2d(3, 4, 3, padding=1)
    winograd_everywhere(layer, (7, 6, 7, 3), images=2)
    bind_flat(layer, np, np.float32, seed=3)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((7, 6, 7, 3)).astype(np.float32)
    dy = rng.standard_normal((7, 6, 7, 4)).astype(np.float32)
    backend.set_compute_threads(threads)
    first, second = _step(layer, x, dy, 1), _step(layer, x, dy, 1)
    assert first[0] and second[0]
    assert_same_step(first, second)


def test_winograd_reports_ready_after_its_gradients(winograd_everywhere):
    layer = Conv2d(2, 3, 3, padding=1)
    winograd_everywhere(layer, (3, 4, 4, 2), images=2)
    bind_flat(layer, np, np.float64, seed=0)
    y = layer.forward(np.ones((3, 4, 4, 2)))
    reported = []
    layer.backward(np.ones_like(y), ready=lambda end: reported.append((end, layer.g["W"].sum())))
    assert reported == [(layer.grad_end, layer.g["W"].sum())]


def test_first_layer_skips_the_input_gradient(winograd_everywhere):
    layer = Conv2d(2, 3, 3, padding=1)
    winograd_everywhere(layer, (3, 5, 4, 2), images=2)
    bind_flat(layer, np, np.float64, seed=0)
    rng = np.random.default_rng(5)
    x, dy = rng.standard_normal((3, 5, 4, 2)), rng.standard_normal((3, 5, 4, 3))
    _, _, _, grads = _step(layer, x, dy, blas_threads=1)
    layer.input_grad = False
    layer.forward(x)
    assert layer.winograd and layer.backward(dy) is None
    assert np.array_equal(layer.g["W"], grads["W"])


def test_stack_of_winograd_layers_with_relu_in_place(winograd_everywhere):
    """Two Winograd convolutions with an in-place ReLU between them (fresh_output): the
    gradients of the stack match finite differences."""
    first, second = Conv2d(2, 3, 3, padding=1), Conv2d(3, 2, 3, padding=0)
    winograd_everywhere(first, (2, 6, 5, 3), images=1)
    check_layer(Sequential([first, ReLU(), second]), (2, 6, 5, 2), np, params_checked=60)
    assert first.winograd and second.winograd


def test_selection_rule(monkeypatch):
    x = np.zeros((8, 16, 16, 32), np.float32)
    before = backend.blas_threads()
    try:
        backend.set_blas_threads(1)
        backend.set_compute_threads(1)
        assert Conv2d(32, 32, 3, padding=1).uses_winograd(x)
        assert Conv2d(32, 64, 3, padding=0).uses_winograd(x)
        assert not Conv2d(32, 32, 3, stride=2, padding=1).uses_winograd(x)  # strided
        assert not Conv2d(32, 32, 1).uses_winograd(x)  # not 3x3
        assert not Conv2d(16, 16, 3, padding=1).uses_winograd(x[..., :16])  # measured slower
        assert not Conv2d(32, 16, 3, padding=1).uses_winograd(x)
        monkeypatch.setattr(conv_winograd, "WINOGRAD_MIN_CHANNELS", 16)
        assert Conv2d(16, 16, 3, padding=1).uses_winograd(x[..., :16])
        backend.set_compute_threads(2)  # two chunk threads: only wide layers on large maps
        assert not Conv2d(32, 32, 3, padding=1).uses_winograd(x)
        wide = np.zeros((2, 14, 14, 64), np.float32)
        assert Conv2d(64, 64, 3, padding=1).uses_winograd(wide)
        assert not Conv2d(64, 64, 3, padding=0).uses_winograd(wide)  # 12x12 out
        assert not Conv2d(64, 64, 3, padding=1).uses_winograd(wide[:, :8, :8])
        backend.set_compute_threads(1)
        backend.set_blas_threads(2)  # whole-batch GEMMs on a multithreaded BLAS: im2col
        assert not Conv2d(32, 32, 3, padding=1).uses_winograd(x)
    finally:
        backend.set_blas_threads(before)
        backend.set_compute_threads(1)


def test_weight_transforms_are_exact_inverses_in_the_gradient():
    """weight_grad(V^T dM) is the gradient of sum(U * dM) w.r.t. g, U = transform_weight(g)."""
    rng = np.random.default_rng(4)
    g = rng.standard_normal((3, 3, 2, 3))
    du = rng.standard_normal((16, 2, 3))
    dg = np.empty_like(g)
    winograd.weight_grad(du, dg)
    # sum(U * du) is linear in g: its gradient is the same linear map applied to the basis
    expected = np.array(
        [(winograd.transform_weight(e.reshape(g.shape)) * du).sum() for e in np.eye(g.size)]
    )
    np.testing.assert_allclose(dg.reshape(-1), expected, rtol=1e-12, atol=1e-12)


def test_conv_winograd_does_not_import_conv():
    """The dependency runs one way: conv uses conv_winograd, which knows the layer only as a
    ChunkedConv (issue 25: no import circle between the two modules)."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(conv_winograd.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
            imported.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
    assert not {m for m in imported if m.startswith("hpcdl.nn.conv") and "winograd" not in m}


def test_conv2d_has_what_the_winograd_path_uses(winograd_everywhere):
    """Every member of conv_winograd.ChunkedConv exists on a Conv2d that ran a Winograd step."""
    layer = Conv2d(4, 4, kernel=3, padding=1)
    bind_flat(layer, np, np.float64, seed=1)
    x = np.random.default_rng(0).standard_normal((2, 6, 6, 4))
    layer.forward(x)
    assert layer.winograd
    members = set(conv_winograd.ChunkedConv.__annotations__) | {
        name
        for name, value in vars(conv_winograd.ChunkedConv).items()
        if callable(value) and not name.startswith("__")
    }
    missing = sorted(name for name in members if not hasattr(layer, name))
    assert not missing
