"""The dtypes of a step at each --precision, emulated (float32 arrays) or real (half arrays).

One table says what every array of a step holds, so the kernels and the model agree:

| arrays | fp32 | bf16 / fp16 emulated | bf16 / fp16 real (--gpu-kernels on CuPy) |
|---|---|---|---|
| activations, input gradients | float32 | float32 rounded to the format | the format |
| weights a forward uses | float32 | float32 rounded | float32 rounded, cast per GEMM |
| logits (the loss's input) | float32 | float32 rounded | float32 (cast from the format) |
| master weights, weight gradients, optimizer state | float32 | float32 | float32 |
| GEMM / convolution sums, BatchNorm statistics, loss | float32 | float32 | float32 |

bf16 is ml_dtypes.bfloat16 on NumPy and on CuPy (CuPy 14 takes it as an array dtype), fp16 is
float16. Emulated values are exactly the format's (hpcdl.nn.precision rounds to nearest, ties to
even, as a cast does; tests/test_nn_dtypes.py checks the two agree bit for bit), so a real
kernel may cast an emulated activation to the format without losing anything and add its
products in float32: the same numbers up to the order of the sums. fp16 keeps its loss scaling
either way.

Real arrays run from layer to layer (Model.set_precision(real=True)): every layer takes and
returns its input's dtype; a GEMM multiplies arrays of the format and sums in float32
(`matmul`); BatchNorm's reference and the global average pool sum in float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from hpcdl.backend import array_module
from hpcdl.nn import kernels
from hpcdl.nn.kernels.gemm import device_matmul
from hpcdl.nn.precision import check_precision

FLOAT32 = np.dtype(np.float32)


@dataclass(frozen=True)
class StepDtypes:
    """What a step's arrays hold (module table)."""

    precision: str
    activations: np.dtype  # layer outputs and input gradients, as arrays
    weights: np.dtype  # the copy of the masters a forward uses
    real: bool  # arrays of the format (True), or float32 holding its values (False)
    master: np.dtype = FLOAT32  # parameters the optimizer updates, allreduces, checkpoints
    gradients: np.dtype = FLOAT32  # weight gradients, summed in float32
    optimizer_state: np.dtype = FLOAT32
    accumulate: np.dtype = FLOAT32  # GEMM sums, BatchNorm statistics, the loss

    @property
    def loss_scaling(self) -> bool:
        """fp16 scales the loss (LossScaler), emulated or real."""
        return self.precision == "fp16"


def half_dtype(precision: str) -> np.dtype:
    """The array dtype of a format: float32, ml_dtypes.bfloat16 or float16."""
    check_precision(precision)
    if precision == "fp32":
        return FLOAT32
    if precision == "fp16":
        return np.dtype(np.float16)
    try:
        import ml_dtypes  # noqa: PLC0415
    except ImportError:
        raise ValueError(
            "bf16 arrays need the ml_dtypes package; install hpcdl's gpu extra "
            "(pip install 'hpcdl[gpu]') or leave out --gpu-kernels"
        ) from None
    return np.dtype(ml_dtypes.bfloat16)


def step_dtypes(precision: str, real: bool) -> StepDtypes:
    """The dtypes of a step at `precision`; real: half arrays (the kernels of --gpu-kernels)."""
    held = half_dtype(precision) if real else FLOAT32
    return StepDtypes(precision, held, held, real and precision != "fp32")


def matmul(a: Any, b: Any, out: Any) -> Any:
    """out = a @ b with float32 sums, whatever the operands' format (float32 or half).

    No half array among them (float32, float64): the backend's matmul itself. On CuPy, cuBLAS
    multiplies half operands with a float32 sum (tensor cores); into an out of another dtype
    the product is cast. With --gpu-kernels on CuPy, cuBLAS is called on a handle of hpcdl's
    own, which a CUDA graph can capture (NOTE [capturable GEMM] in hpcdl/nn/kernels/gemm.py),
    and half operands write a float32 out directly. On NumPy,
    half operands are multiplied as float32 (ml_dtypes and float16 have no BLAS): the same
    numbers, emulated; the result is cast into out (float32 for weight gradients)."""
    xp = array_module(a)
    if xp is not np and kernels.enabled():
        same = b if b.dtype == a.dtype else b.astype(a.dtype, copy=False)
        if device_matmul(xp, a, same, out):
            return out
    if 2 not in (a.dtype.itemsize, b.dtype.itemsize, out.dtype.itemsize):
        return xp.matmul(a, b, out=out)
    if xp is not np:
        if a.dtype == b.dtype == out.dtype:
            return xp.matmul(a, b, out=out)
        out[...] = xp.matmul(a, b.astype(a.dtype, copy=False))
        return out
    wide = np.result_type(FLOAT32, out.dtype) if out.dtype.itemsize > 2 else FLOAT32
    out[...] = np.matmul(a.astype(wide, copy=False), b.astype(wide, copy=False))
    return out


def sum_dtype(x: Any) -> Any:
    """The dtype a reduction over x sums in: float32 for half arrays, else x's own (None)."""
    return FLOAT32 if x.dtype.itemsize == 2 else None


def cast(x: Any, dtype: np.dtype, out: Any = None) -> Any:
    """x as dtype (round to nearest, ties to even; beyond the range +-inf), into out if given."""
    if out is None:
        return x.astype(dtype, copy=False)
    out[...] = x
    return out
