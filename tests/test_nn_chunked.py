"""Conv2d's chunked path (one BLAS thread; chunks on one or two threads) against its
whole-batch path and finite differences.

Float64 throughout: the chunked path sums dW chunk by chunk, so it may differ from the
whole-batch GEMM by rounding only, and it must repeat bitwise run to run."""

from __future__ import annotations

import numpy as np
import pytest
from gradcheck import assert_same_step, check_layer, conv_step

from hpcdl import backend
from hpcdl.comm import blas_threads
from hpcdl.nn import Conv2d, conv
from hpcdl.nn.model import bind_flat

CASES = [
    # (c_in, c_out, kernel, stride, padding, (N, H, W)); N not a multiple of the chunk
    (3, 3, 3, 1, 1, (7, 6, 5)),  # 'same', dilated input gradient
    (3, 4, 3, 1, 0, (7, 6, 7)),  # 'valid', widening: col2im
    (2, 4, 3, 2, 1, (5, 7, 6)),  # stride 2, odd size: col2im
    (2, 2, (2, 3), (1, 2), (0, 1), (5, 4, 5)),  # rectangular, strided: col2im
    (2, 2, 3, 1, 2, (4, 4, 4)),  # padding wider than the kernel's reach: dilated
]


@pytest.fixture
def one_blas_thread(monkeypatch):
    """Layers see one BLAS thread; the fixture's value sets CHUNK_BYTES to `images` images of a
    float64 input (h, w, c) of the layer."""
    before = backend.blas_threads()
    backend.set_blas_threads(1)
    monkeypatch.setattr(conv, "MIN_CHUNK_MACS", 0)  # chunks set by CHUNK_BYTES alone

    def chunk_of(layer, hwc, images):
        ho, wo = layer.output_hw(hwc[0], hwc[1])
        monkeypatch.setattr(
            conv, "CHUNK_BYTES", images * ho * wo * layer.kh * layer.kw * hwc[2] * 8
        )

    yield chunk_of
    backend.set_blas_threads(before)
    backend.set_compute_threads(1)


@pytest.mark.parametrize("c_in,c_out,kernel,stride,padding,nhw", CASES)
def test_chunked_equals_whole_batch(one_blas_thread, c_in, c_out, kernel, stride, padding, nhw):
    layer = Conv2d(c_in, c_out, kernel, stride=stride, padding=padding)
    one_blas_thread(layer, (*nhw[1:], c_in), 2)
    bind_flat(layer, np, np.float64, seed=1)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((*nhw, c_in))
    dy = rng.standard_normal(layer.forward(x).shape)
    chunk, y, dx, grads = conv_step(layer, x, dy, blas_threads=1)
    assert chunk == 2
    whole_chunk, y0, dx0, grads0 = conv_step(layer, x, dy, blas_threads=None)
    assert whole_chunk == 0
    np.testing.assert_allclose(y, y0, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dx, dx0, rtol=1e-12, atol=1e-12)
    for name in grads0:
        np.testing.assert_allclose(grads[name], grads0[name], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("c_in,c_out,kernel,stride,padding,nhw", CASES)
def test_chunks_on_two_threads_equal_whole_batch(
    one_blas_thread, c_in, c_out, kernel, stride, padding, nhw
):
    layer = Conv2d(c_in, c_out, kernel, stride=stride, padding=padding)
    one_blas_thread(layer, (*nhw[1:], c_in), 1)  # N chunks over 2 threads, an odd N included
    bind_flat(layer, np, np.float64, seed=1)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((*nhw, c_in))
    dy = rng.standard_normal(layer.forward(x).shape)
    backend.set_compute_threads(2)
    chunk, y, dx, grads = conv_step(layer, x, dy, blas_threads=1)
    assert chunk == 1
    _, y0, dx0, grads0 = conv_step(layer, x, dy, blas_threads=None)
    np.testing.assert_allclose(y, y0, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dx, dx0, rtol=1e-12, atol=1e-12)
    for name in grads0:
        np.testing.assert_allclose(grads[name], grads0[name], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("c_in,c_out,kernel,stride,padding,nhw", CASES[:3])
def test_chunked_matches_finite_differences(
    one_blas_thread, threads, c_in, c_out, kernel, stride, padding, nhw
):
    backend.set_compute_threads(threads)
    layer = Conv2d(c_in, c_out, kernel, stride=stride, padding=padding)
    one_blas_thread(layer, (*nhw[1:], c_in), 2)
    check_layer(layer, (*nhw, c_in), np)
    assert layer.chunk == 2


@pytest.mark.parametrize("threads", [1, 2])
def test_chunked_is_bitwise_repeatable(one_blas_thread, threads):
    backend.set_compute_threads(threads)
    layer = Conv2d(3, 4, 3, padding=1)
    one_blas_thread(layer, (6, 7, 3), 3)
    bind_flat(layer, np, np.float64, seed=3)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((7, 6, 7, 3))
    dy = rng.standard_normal((7, 6, 7, 4))
    first = conv_step(layer, x, dy, blas_threads=1)
    second = conv_step(layer, x, dy, blas_threads=1)
    assert first[0] == 3
    assert_same_step(first, second)


def test_chunk_size_follows_blas_threads_and_chunk_bytes(monkeypatch):
    layer = Conv2d(16, 16, 3, padding=1)
    monkeypatch.setattr(conv, "MIN_CHUNK_MACS", 0)  # the byte budget alone
    x = np.zeros((64, 32, 32, 16), np.float32)  # 32*32*9*16*4 = 576 KiB of columns per image
    monkeypatch.setattr(conv, "CHUNK_BYTES", 2 << 20)
    before = backend.blas_threads()
    try:
        backend.set_blas_threads(2)
        assert layer.chunk_images(x) == 0
        backend.set_blas_threads(None)
        assert layer.chunk_images(x) == 0
        backend.set_blas_threads(1)
        assert layer.chunk_images(x) == 3
        assert layer.chunk_images(x[:3]) == 0  # one chunk would hold the batch: whole batch
        monkeypatch.setattr(conv, "CHUNK_BYTES", 1)
        assert layer.chunk_images(x) == 1
    finally:
        backend.set_blas_threads(before)


def test_use_layer_threads_sets_one_blas_thread_and_the_chunk_threads():
    before = blas_threads.current().threads
    try:
        pool = blas_threads.use_layer_threads(2)
        assert pool.threads == blas_threads.current().threads == 1
        assert (backend.blas_threads(), backend.compute_threads()) == (1, 2)
    finally:
        blas_threads.apply(before)
        backend.set_blas_threads(None)
        backend.set_compute_threads(1)


def test_apply_records_the_blas_threads_for_layers():
    before = blas_threads.current().threads
    try:
        pool = blas_threads.apply(1)
        assert backend.blas_threads() == pool.threads
    finally:
        blas_threads.apply(before)
        backend.set_blas_threads(None)
