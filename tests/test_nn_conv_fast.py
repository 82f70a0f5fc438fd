"""Conv2d's GEMMs split into OpenBLAS small-matrix-kernel pieces (chunked path only).

Float64 against the whole-batch path (one GEMM each) and finite differences, with the block
limits shrunk so that these small layers are split the way resnet20's layers are."""

from __future__ import annotations

import numpy as np
import pytest
from gradcheck import assert_same_step, check_layer, conv_step

from hpcdl import backend
from hpcdl.nn import Conv2d, conv
from hpcdl.nn.model import bind_flat

CASES = [
    # (c_in, c_out, kernel, stride, padding, (N, H, W))
    (3, 3, 3, 1, 1, (7, 6, 5)),  # 'same': dilated input gradient
    (3, 4, 3, 1, 0, (7, 6, 7)),  # widening: col2im with a contiguous W.T
    (2, 4, 3, 2, 1, (5, 7, 6)),  # stride 2: col2im
]
# How the weight gradient of a chunk is split: (MIN_ROW_BLOCK_WEIGHT_GRAD, MIN_K_BLOCK_...)
WEIGHT_GRAD_SPLITS = {"rows": (1, 1), "k": (10**9, 1), "whole": (10**9, 10**9)}


@pytest.fixture
def small_blocks(monkeypatch):
    """One BLAS thread, chunks of 2 float64 images, and GEMM pieces of a few rows: split(mode)
    sets how the weight gradient is split."""
    before = backend.blas_threads()
    backend.set_blas_threads(1)
    monkeypatch.setattr(conv, "SMALL_GEMM", 400)
    monkeypatch.setattr(conv, "MIN_BLOCK_ROWS", 1)
    monkeypatch.setattr(conv, "MIN_CHUNK_MACS", 0)

    def split(layer, hwc, mode):
        ho, wo = layer.output_hw(hwc[0], hwc[1])
        chunk_bytes = 2 * ho * wo * layer.kh * layer.kw * hwc[2] * 8
        monkeypatch.setattr(conv, "CHUNK_BYTES", chunk_bytes)
        rows, k = WEIGHT_GRAD_SPLITS[mode]
        monkeypatch.setattr(conv, "MIN_ROW_BLOCK_WEIGHT_GRAD", rows)
        monkeypatch.setattr(conv, "MIN_K_BLOCK_WEIGHT_GRAD", k)

    yield split
    backend.set_blas_threads(before)
    backend.set_compute_threads(1)


@pytest.mark.parametrize("mode", sorted(WEIGHT_GRAD_SPLITS))
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("c_in,c_out,kernel,stride,padding,nhw", CASES)
def test_split_gemms_equal_whole_batch(
    small_blocks, mode, threads, c_in, c_out, kernel, stride, padding, nhw
):
    layer = Conv2d(c_in, c_out, kernel, stride=stride, padding=padding)
    small_blocks(layer, (*nhw[1:], c_in), mode)
    bind_flat(layer, np, np.float64, seed=1)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((*nhw, c_in))
    dy = rng.standard_normal(layer.forward(x).shape)
    backend.set_compute_threads(threads)
    chunk, y, dx, grads = conv_step(layer, x, dy, blas_threads=1)
    assert chunk == 2
    whole_chunk, y0, dx0, grads0 = conv_step(layer, x, dy, blas_threads=None)
    assert whole_chunk == 0
    np.testing.assert_allclose(y, y0, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dx, dx0, rtol=1e-12, atol=1e-12)
    for name in grads0:
        np.testing.assert_allclose(grads[name], grads0[name], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", sorted(WEIGHT_GRAD_SPLITS))
@pytest.mark.parametrize("c_in,c_out,kernel,stride,padding,nhw", CASES)
def test_split_gemms_match_finite_differences(
    small_blocks, mode, c_in, c_out, kernel, stride, padding, nhw
):
    layer = Conv2d(c_in, c_out, kernel, stride=stride, padding=padding)
    small_blocks(layer, (*nhw[1:], c_in), mode)
    check_layer(layer, (*nhw, c_in), np)
    assert layer.chunk == 2


@pytest.mark.parametrize("threads", [1, 2])
def test_split_gemms_are_bitwise_repeatable(small_blocks, threads):
    backend.set_compute_threads(threads)
    layer = Conv2d(3, 4, 3, padding=1)
    small_blocks(layer, (6, 7, 3), "rows")
    bind_flat(layer, np, np.float64, seed=3)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((7, 6, 7, 3))
    dy = rng.standard_normal((7, 6, 7, 4))
    first = conv_step(layer, x, dy, blas_threads=1)
    second = conv_step(layer, x, dy, blas_threads=1)
    assert first[0] == 2
    assert_same_step(first, second)


@pytest.mark.parametrize("mode", sorted(WEIGHT_GRAD_SPLITS))
def test_weight_grad_split_equals_one_gemm(small_blocks, mode):
    layer = Conv2d(4, 5, 3)
    small_blocks(layer, (5, 5, 4), mode)
    rng = np.random.default_rng(2)
    cols, dy = rng.standard_normal((37, 36)), rng.standard_normal((37, 5))
    out = np.full((36, 5), np.nan)
    layer._gemm_weight_grad(cols, dy, out, slot=0)
    np.testing.assert_allclose(out, cols.T @ dy, rtol=1e-12, atol=1e-12)


def test_chunked_col2im_weight_is_contiguous(small_blocks):
    layer = Conv2d(2, 4, 3, stride=2, padding=1)
    small_blocks(layer, (7, 6, 2), "rows")
    bind_flat(layer, np, np.float64, seed=0)
    layer.forward(np.zeros((5, 7, 6, 2)))
    assert layer.chunk == 2 and layer.col2im_input_grad
    w_t = layer._input_grad_weight(np)
    assert w_t.flags.c_contiguous
    assert np.array_equal(w_t, layer.p["W"].reshape(-1, 4).T)


def test_chunk_holds_at_least_min_chunk_macs(monkeypatch):
    layer = Conv2d(16, 16, 3, padding=1)
    x = np.zeros((64, 32, 32, 16), np.float32)  # 32*32*9*16*16 = 2.4M multiply-adds per image
    before = backend.blas_threads()
    try:
        backend.set_blas_threads(1)
        monkeypatch.setattr(conv, "CHUNK_BYTES", 1)
        monkeypatch.setattr(conv, "MIN_CHUNK_MACS", 6_000_000)
        assert layer.chunk_images(x) == 3
        monkeypatch.setattr(conv, "CHUNK_BYTES", 4 << 20)  # 7 images of columns: bytes decide
        assert layer.chunk_images(x) == 7
    finally:
        backend.set_blas_threads(before)


@pytest.mark.parametrize("contiguous", [True, False])
def test_gemm_blocks_write_into_out(small_blocks, contiguous):
    layer = Conv2d(4, 5, 3)
    small_blocks(layer, (5, 5, 4), "rows")
    bind_flat(layer, np, np.float64, seed=0)
    layer.forward(np.zeros((5, 5, 5, 4)))  # sets the chunk: the blocked path
    assert layer.chunk == 2
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((41, 36)), rng.standard_normal((36, 5))
    target = np.full((41, 10), np.nan)
    out = target[:, :5] if not contiguous else np.full((41, 5), np.nan)
    layer._gemm(np, a, b, out)
    np.testing.assert_allclose(out, a @ b, rtol=1e-12, atol=1e-12)
