"""hpcdl.nn.dtypes: what a step's arrays hold at each --precision, and that the emulation's
rounding is the real cast, bit for bit (so a real-half kernel may take emulated values)."""

import numpy as np
import pytest

from hpcdl import nn
from hpcdl.nn import dtypes
from hpcdl.nn.precision import round_in_place

ml_dtypes = pytest.importorskip("ml_dtypes")  # in the test and gpu extras


def awkward_float32(n=20_000):
    """Random values over many binades, plus ties, the formats' edges, subnormals and NaN."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(n) * np.exp2(rng.integers(-30, 30, n))).astype(np.float32)
    bits = np.array(
        [0x3F808000, 0x3F818000, 0x477FF000, 0x477FEFFF, 0x33800000, 0x00000001, 0x7F7FFFFF],
        np.uint32,
    )  # bf16 ties (even and odd), fp16's overflow edge and either side, fp16 subnormal, tiny
    edges = np.concatenate([bits.view(np.float32), [65520.0, -65520.0, 65519.0, np.nan, 0.0]])
    return np.concatenate([x, edges.astype(np.float32)])


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_the_emulated_rounding_is_the_real_cast(precision):
    x = awkward_float32()
    emulated = x.copy()
    with np.errstate(over="ignore"):
        round_in_place(emulated, precision)
        real = x.astype(dtypes.half_dtype(precision)).astype(np.float32)
    np.testing.assert_array_equal(np.isnan(emulated), np.isnan(real))
    same = ~np.isnan(real)
    assert np.array_equal(emulated[same].view(np.uint32), real[same].view(np.uint32))


def test_step_dtypes_keep_masters_gradients_state_and_sums_in_float32():
    real_bf16 = dtypes.step_dtypes("bf16", real=True)
    assert real_bf16.activations == np.dtype(ml_dtypes.bfloat16) == real_bf16.weights
    assert real_bf16.real and not real_bf16.loss_scaling
    for d in (real_bf16, dtypes.step_dtypes("fp16", True), dtypes.step_dtypes("bf16", False)):
        assert {d.master, d.gradients, d.optimizer_state, d.accumulate} == {np.dtype(np.float32)}
    real_fp16 = dtypes.step_dtypes("fp16", real=True)
    assert real_fp16.activations == np.float16 and real_fp16.loss_scaling
    emulated = dtypes.step_dtypes("fp16", real=False)
    assert emulated.activations == np.float32 and not emulated.real and emulated.loss_scaling
    assert not dtypes.step_dtypes("fp32", real=True).real
    with pytest.raises(ValueError, match="precision must be one of"):
        dtypes.step_dtypes("fp8", real=True)


def test_a_half_gemm_into_float32_sums_in_float32():
    """fp32 accumulation: bf16 operands, float32 out, the float32 GEMM of the same values."""
    rng = np.random.default_rng(1)
    bf16 = dtypes.half_dtype("bf16")
    a = dtypes.cast(rng.standard_normal((16, 300)).astype(np.float32), bf16)
    b = dtypes.cast(rng.standard_normal((300, 8)).astype(np.float32), bf16)
    out = np.empty((16, 8), np.float32)
    np.matmul(a, b, out=out)
    np.testing.assert_allclose(out, a.astype(np.float32) @ b.astype(np.float32), rtol=1e-5)
    assert a.dtype == bf16 and dtypes.cast(out, bf16, np.empty((16, 8), bf16)).dtype == bf16


def test_the_model_tells_its_layers_the_format_they_compute_on():
    model = nn.build_model("cnn", (1, 8, 8), 10)
    assert {leaf.precision for leaf in model.body.leaves()} == {"fp32"}
    model.set_precision("bf16")
    assert {leaf.precision for leaf in model.body.leaves()} == {"bf16"}
