"""hpcdl.nn.kernels.pool: CupyMaxPool's CUDA source, compiled and run on the CPU
(tests/cuda_on_cpu.py), is MaxPool2d forward and backward bit for bit in float32, bf16 and
fp16 (the real half arrays), tied maxima shared as the reference shares them; marked gpu: the
CuPy kernels themselves against the reference."""

import ml_dtypes
import numpy as np
import pytest
from cuda_on_cpu import CpuKernel, host_preamble

from hpcdl.backend import cupy_or_none, gpu_available
from hpcdl.nn import kernels
from hpcdl.nn.kernels.half_bits import bits, format_of
from hpcdl.nn.kernels.pool import CupyMaxPool, geometry, kernel_sources
from hpcdl.nn.layers import MaxPool2d

SHAPES = [  # (kernel, stride, padding, H, W): tiled, tiled with a leftover row, overlapping
    (2, 2, 0, 6, 6),
    (2, 2, 0, 7, 5),
    (3, 2, 1, 7, 8),
    (3, 1, 0, 5, 5),
    (3, 2, 0, 9, 9),
]


DTYPES = [np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16)]


def relu_input(h, w, seed=0, dtype=np.float32):
    """After a ReLU of a shifted normal: most values are 0, so tied zeros are common. In a
    half format, equal nonzero maxima are common too (3 bits of mantissa fewer per tie)."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((2, h, w, 3)) - 0.8).astype(np.float32)
    return np.maximum(x, 0, out=x).astype(dtype)


def gradient(shape, dtype):
    return np.random.default_rng(1).standard_normal(shape).astype(np.float32).astype(dtype)


def ties_of(x, y, layer):
    """How many elements of each window equal its maximum (in float32, as the kernel counts)."""
    h_in, w_in, _, ho, wo, kh, kw, sh, sw, ph, pw = geometry(layer, x.shape)
    ties = np.zeros(y.shape, np.float32)
    for oh in range(ho):
        for ow in range(wo):
            for a in range(kh):
                for b in range(kw):
                    h, w = oh * sh - ph + a, ow * sw - pw + b
                    if 0 <= h < h_in and 0 <= w < w_in:
                        ties[:, oh, ow] += x[:, h, w] == y[:, oh, ow]
    return ties


SCALARS = frozenset({"H", "W", "C", "Ho", "Wo", "kh", "kw", "sh", "sw", "ph", "pw", "tiled"})


@pytest.fixture(scope="module")
def on_cpu(tmp_path_factory):
    """dtype -> (forward, backward): the kernels' CUDA source built for the CPU."""
    folder, built = tmp_path_factory.mktemp("pool_kernels"), {}

    def kernels_for(dtype):
        fmt = format_of(dtype)
        if fmt not in built:
            built[fmt] = tuple(
                CpuKernel(*source, host_preamble(fmt), folder, scalars=SCALARS)
                for source in kernel_sources(fmt)
            )
        return built[fmt]

    return kernels_for


def held(array):
    """What the kernels take: float32 as it is, a half array as its bits."""
    return array if array.dtype == np.float32 else bits(array)


def pooled(on_cpu, layer, x):
    """(y, ties) from the forward kernel."""
    geo = geometry(layer, x.shape)
    y = np.empty((x.shape[0], geo[3], geo[4], x.shape[3]), x.dtype)
    ties = np.empty(y.shape, np.float32)
    on_cpu(x.dtype)[0](held(x), *geo, held(y), ties, size=y.size)
    return y, ties


def pooled_gradient(on_cpu, layer, x, y, ties, dy):
    """dx from the backward kernel."""
    dx = np.empty_like(x)
    geo = geometry(layer, x.shape)
    on_cpu(x.dtype)[1](held(x), held(y), ties, held(dy), layer.tiled, *geo, held(dx), size=x.size)
    return dx


def same_bits(got, expected):
    assert got.dtype == expected.dtype
    np.testing.assert_array_equal(got.view(np.uint8), expected.view(np.uint8))  # zeros' signs too


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize(("k", "s", "p", "h", "w"), SHAPES)
def test_the_kernels_source_is_the_reference_bitwise(on_cpu, k, s, p, h, w, dtype):
    layer = MaxPool2d(k, s, p)
    x = relu_input(h, w, dtype=dtype)
    expected_y = layer.forward(x)
    dy = gradient(expected_y.shape, dtype)
    expected_dx = layer.backward(dy)
    y, ties = pooled(on_cpu, layer, x)
    same_bits(y, expected_y)
    np.testing.assert_array_equal(ties, ties_of(x, y, layer))
    assert (ties > 1).any()  # shared maxima are exercised
    same_bits(pooled_gradient(on_cpu, layer, x, y, ties, dy), expected_dx)


def test_a_nan_in_a_window_is_its_maximum(on_cpu):
    layer = MaxPool2d(2)
    x = relu_input(4, 4, dtype=ml_dtypes.bfloat16)
    x[0, 1, 1, 0] = np.nan
    y, _ = pooled(on_cpu, layer, x)
    assert np.isnan(np.float32(y[0, 0, 0, 0])) and np.isnan(layer.forward(x)[0, 0, 0, 0])
    assert np.isfinite(y.astype(np.float32)).sum() == y.size - 1


def test_the_half_kernel_rounds_each_share_and_sum_to_the_format(on_cpu):
    """Overlapping 3x3 windows of zeros tie 9 ways and add up to 9 shares per input: rounded
    to bf16 after every add, as the reference and the kernel do, they differ from a float32
    sum rounded once (so the bitwise test above tells the two apart)."""
    layer = MaxPool2d(3, 1, 0)
    x = np.zeros((2, 8, 8, 4), ml_dtypes.bfloat16)
    y = layer.forward(x)
    dy = gradient(y.shape, x.dtype)
    expected = layer.backward(dy)
    y, ties = pooled(on_cpu, layer, x)
    got = pooled_gradient(on_cpu, layer, x, y, ties, dy)
    same_bits(got, expected)
    shares = (dy.astype(np.float32) / 9).astype(x.dtype).astype(np.float32)
    summed_once = np.zeros(x.shape, np.float32)
    for a in range(3):
        for b in range(3):
            summed_once[:, a : a + 6, b : b + 6] += shares
    assert (got != summed_once.astype(x.dtype)).any()


def test_on_the_cpu_the_seam_keeps_the_reference(monkeypatch):
    monkeypatch.setattr(kernels, "_enabled", True)
    layer = MaxPool2d(2)
    x = relu_input(4, 4)
    assert not CupyMaxPool().applies(layer, x)
    layer.forward(x)
    assert layer.seam.kernel is None


def test_the_seam_takes_half_arrays_and_no_other_dtype():
    kernel, layer = CupyMaxPool(), MaxPool2d(2)

    class OnDevice:  # what applies() reads of a CuPy array, for a NumPy one
        def __init__(self, dtype):
            self.dtype, self.flags = np.dtype(dtype), np.ones(1).flags

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("hpcdl.nn.kernels.pool.array_module", lambda x: None)
        patch.setattr("hpcdl.nn.kernels.pool._usable", lambda xp, x: True)
        taken = [kernel.applies(layer, OnDevice(d)) for d in (*DTYPES, np.float64, np.int8)]
    assert taken == [True, True, True, False, False]


def test_kernels_that_do_not_build_leave_the_layer_its_own_code_said_once(monkeypatch, capsys):
    """A kernel NVRTC refuses (or that fails at its first launch) is tried once per format on
    one element; the layer then runs its own code, and one line says why."""
    tries = []

    def refusing_kernel(*source, **options):
        def launch(*args):
            tries.append(source[-1])
            raise RuntimeError("nvrtc: error: identifier undefined")

        return launch

    device = type("Device", (), {"ElementwiseKernel": staticmethod(refusing_kernel),
                                 "ascontiguousarray": staticmethod(np.ascontiguousarray),
                                 "empty_like": staticmethod(np.empty_like),
                                 "empty": staticmethod(np.empty)})  # fmt: skip
    monkeypatch.setattr("hpcdl.nn.kernels.pool.array_module", lambda x: device)
    monkeypatch.setattr("hpcdl.nn.kernels.pool._CUPY_KERNELS", {})
    monkeypatch.setattr("hpcdl.nn.kernels.pool._USABLE", {})
    monkeypatch.setattr(kernels, "_said", set())
    x = relu_input(4, 4, dtype=ml_dtypes.bfloat16)
    assert not CupyMaxPool().applies(MaxPool2d(2), x)
    assert not CupyMaxPool().applies(MaxPool2d(3, 2, 1), x)
    assert len(tries) == 1  # tried once per format
    err = capsys.readouterr().err
    assert err.count("max-pool kernel off in bfloat16 (nvrtc: error") == 1
    assert "MaxPool2d runs its own code" in err


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a GPU")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize(("k", "s", "p", "h", "w"), SHAPES)
def test_the_cupy_kernels_are_the_reference_bitwise_on_the_gpu(monkeypatch, k, s, p, h, w, dtype):
    cp = cupy_or_none()
    x = cp.asarray(relu_input(h, w, dtype=dtype))
    dy = None
    results = []
    for on in (True, False):
        monkeypatch.setattr(kernels, "_enabled", on)
        layer = MaxPool2d(k, s, p)
        y = layer.forward(x)
        assert (layer.seam.kernel is not None) == on
        if dy is None:
            dy = cp.asarray(gradient(y.shape, dtype))
        results.append((cp.asnumpy(y), cp.asnumpy(layer.backward(dy))))
    for got, expected in zip(results[0], results[1]):
        assert got.dtype == expected.dtype == dtype
        np.testing.assert_array_equal(got.view(np.uint8), expected.view(np.uint8))
