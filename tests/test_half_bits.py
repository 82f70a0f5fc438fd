"""hpcdl.nn.kernels.half_bits: the C conversions the half-precision kernels are built with,
compiled here for the CPU from the same text (tests/cuda_on_cpu.py), against NumPy's float16
and ml_dtypes' bfloat16 casts: every one of the 65,536 half values loaded, and float32 values
at and around every rounding boundary (ties, overflow, subnormals, NaN, infinities) stored."""

import ml_dtypes
import numpy as np
import pytest
from cuda_on_cpu import CpuKernel, host_preamble

from hpcdl.nn.kernels.half_bits import bits, format_of, preamble

DTYPES = {"bf16": np.dtype(ml_dtypes.bfloat16), "fp16": np.dtype(np.float16)}


@pytest.fixture(scope="module")
def converter(tmp_path_factory):
    """fmt, "load" or "store", values -> what LOAD / STORE of that format give, run on the CPU."""
    folder = tmp_path_factory.mktemp("half_bits")
    bodies = {"load": ("uint16 h", "float32 f", "f = HPCDL_LOAD(h);"),
              "store": ("float32 f", "uint16 h", "h = HPCDL_STORE(f);")}  # fmt: skip

    def run(fmt: str, mode: str, values: np.ndarray) -> np.ndarray:
        kernel = CpuKernel(*bodies[mode], host_preamble(fmt), folder)
        out = np.empty(values.shape, np.float32 if mode == "load" else np.uint16)
        kernel(np.ascontiguousarray(values), out, size=values.size)
        return out

    return run


def boundary_floats(dtype):
    """float32 values at and one float32 ulp either side of every half value and every
    midpoint between neighbours (the ties), both signs, plus random ones and the specials."""
    last = 0x7C00 if dtype == np.float16 else 0x7F80  # infinity
    halves = np.arange(0, last + 1, dtype=np.uint16).view(dtype).astype(np.float32)
    mids = ((halves[:-1].astype(np.float64) + halves[1:]) / 2).astype(np.float32)
    top = np.float32(65520.0 if dtype == np.float16 else 3.3961776e38)  # the overflow tie
    points = np.concatenate([halves[np.isfinite(halves)], mids, [top]])
    near = [points, np.nextafter(points, np.float32(np.inf)), np.nextafter(points, np.float32(0))]
    rng = np.random.default_rng(0)
    randoms = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    specials = np.array([np.inf, np.nan, 1e-45, 2.0**-25, 2.0**-24, 6.1e-5, 1e38], np.float32)
    values = np.concatenate([*near, randoms, specials])
    return np.concatenate([values, -values]).astype(np.float32)


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_every_half_value_loads_as_numpys_cast(converter, fmt):
    every = np.arange(65536, dtype=np.uint16)
    got = converter(fmt, "load", every)
    expected = every.view(DTYPES[fmt]).astype(np.float32)
    nan = np.isnan(expected)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got.view(np.uint32)[~nan], expected.view(np.uint32)[~nan])


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_stores_round_to_nearest_even_as_numpys_cast(converter, fmt):
    values = boundary_floats(DTYPES[fmt])
    got = converter(fmt, "store", values)
    with np.errstate(invalid="ignore", over="ignore"):
        expected = values.astype(DTYPES[fmt])
    nan = np.isnan(values)
    assert nan.any() and np.isinf(expected.astype(np.float32)).any()
    np.testing.assert_array_equal(np.isnan(got.view(DTYPES[fmt]).astype(np.float32)), nan)
    mismatch = got[~nan] != expected.view(np.uint16)[~nan]
    assert not mismatch.any(), f"{values[~nan][mismatch][:5]} stored as {got[~nan][mismatch][:5]}"


def test_the_formats_are_told_by_dtype():
    assert format_of(np.float16) == "fp16"
    assert format_of(ml_dtypes.bfloat16) == "bf16"
    assert format_of(np.float32) is None
    x = np.ones(3, ml_dtypes.bfloat16)
    assert bits(x).dtype == np.uint16 and bits(x)[0] == 0x3F80
    assert "hpcdl_bf16_store" in preamble("bf16") and "#define HPCDL_ROUND" in preamble("fp16")
    with pytest.raises(ValueError, match="no half format"):
        preamble("fp8")
