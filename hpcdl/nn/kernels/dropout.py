"""Fast kernels for Dropout (NOTE [fast kernels] in hpcdl/nn/kernels/__init__.py).

PhiloxDropout: the mask is Philox4x32-10 words (hpcdl.nn.philox) under a 64-bit seed the layer
draws from the model's dropout generator per mask, as the reference draws its seed: no
generator is built per mask, and NumPy and CuPy give the same mask for the same seed (a word
kept when >= keep_threshold(rate)), so a CPU run and a GPU run drop the same elements. The
reference instead builds xp.random.default_rng(seed) per mask, whose streams differ between
NumPy and CuPy. On CuPy one ElementwiseKernel writes the mask and the output in one pass.
Backward multiplies by the kept mask, as the reference does.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hpcdl.backend import array_module
from hpcdl.nn import philox
from hpcdl.nn.threads import split_multiply

# (in_params, out_params, body) of the CuPy kernel, built with philox.CUDA_SOURCE
KERNEL_SOURCE = (
    "T x, uint32 k0, uint32 k1, uint32 threshold, T scale",
    "T mask, T y",
    "mask = hpcdl_philox_word(i, k0, k1) >= threshold ? scale : (T)0; y = x * mask;",
)
_CUPY_KERNEL: Any = None  # built on first use: compiling needs a GPU


def _cupy_kernel(cp: Any) -> Any:
    global _CUPY_KERNEL
    if _CUPY_KERNEL is None:
        _CUPY_KERNEL = cp.ElementwiseKernel(
            *KERNEL_SOURCE, "hpcdl_philox_dropout", preamble=philox.CUDA_SOURCE
        )
    return _CUPY_KERNEL


class PhiloxDropout:
    """Counter-based dropout on NumPy and CuPy (contiguous inputs)."""

    name = "philox"

    def applies(self, layer: Any, x: Any) -> bool:
        return bool(x.flags.c_contiguous)

    def forward(self, layer: Any, x: Any, train: bool) -> Any:
        xp = array_module(x)
        seed = int(layer.rng.integers(2**63))  # one draw per mask, as the reference's
        threshold = philox.keep_threshold(layer.rate)
        scale = x.dtype.type(1.0 / (1.0 - layer.rate))
        if xp is np:
            keep = philox.words(seed, x.size).reshape(x.shape) >= threshold
            mask = layer.mask = np.multiply(keep, scale, dtype=x.dtype)
            return split_multiply(x, mask)
        k0, k1 = np.uint32(seed & 0xFFFFFFFF), np.uint32(seed >> 32)
        mask, y = _cupy_kernel(xp)(x, k0, k1, np.uint32(threshold), scale)
        layer.mask = mask
        return y

    def backward(self, layer: Any, dy: Any) -> Any:
        return split_multiply(dy, layer.mask)


KERNELS: list[Any] = [PhiloxDropout()]
