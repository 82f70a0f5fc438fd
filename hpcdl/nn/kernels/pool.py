"""Fast kernels for MaxPool2d (NOTE [fast kernels] in hpcdl/nn/kernels/__init__.py).

CupyMaxPool: forward and backward as CuPy ElementwiseKernels on NHWC float32, bf16 or fp16 (the
real half arrays of --precision bf16|fp16), no padded copy. Forward writes, per output, the
maximum and how many window elements equal it (`ties`, what the reference counts in backward);
backward gathers, per input element, the windows that hold it, in the reference's order (window
offsets (i, j) ascending), each giving dy / ties where the element is its window's maximum: the
reference's equal sharing of tied maxima (after a ReLU a window of zeros is common), which an
arg-max index alone would not give. Every product and sum is rounded on its own (__fmul_rn,
__fadd_rn: no FMA), so the bits are the reference's. Half arrays are read and written as their
uint16 bits and computed in float32, each result rounded to the format before it is used again
(NOTE [half bits] in hpcdl/nn/kernels/half_bits.py): what NumPy does for one operation on them.

The CPU test compiles the kernels' own source for the CPU (tests/cuda_on_cpu.py) and checks
both against MaxPool2d bit for bit in the three formats; a `gpu` test runs them on CuPy.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hpcdl.backend import array_module
from hpcdl.nn.kernels import say_once
from hpcdl.nn.kernels.half_bits import bits, format_of, preamble

_GEOMETRY = (
    "int32 H, int32 W, int32 C, int32 Ho, int32 Wo, "
    "int32 kh, int32 kw, int32 sh, int32 sw, int32 ph, int32 pw"
)

_FORWARD = """
int c = i % C, ow = (i / C) % Wo, oh = (i / (C * Wo)) % Ho, n = i / (C * Wo * Ho);
float m = __int_as_float(0xff800000);  // -inf
for (int a = 0; a < kh; ++a) for (int b = 0; b < kw; ++b) {
    int h = oh * sh - ph + a, w = ow * sw - pw + b;
    if (h < 0 || h >= H || w < 0 || w >= W) continue;
    float v = HPCDL_LOAD(x[((n * H + h) * W + w) * C + c]);
    if (isnan(v) || v > m) m = isnan(m) ? m : v;
}
float count = 0.0f;
for (int a = 0; a < kh; ++a) for (int b = 0; b < kw; ++b) {
    int h = oh * sh - ph + a, w = ow * sw - pw + b;
    if (h < 0 || h >= H || w < 0 || w >= W) continue;
    if (HPCDL_LOAD(x[((n * H + h) * W + w) * C + c]) == m) count = __fadd_rn(count, 1.0f);
}
y = HPCDL_STORE(m); ties = count;
"""

_BACKWARD = """
int c = i % C, w = (i / C) % W, h = (i / (C * W)) % H, n = i / (C * W * H);
float acc = 0.0f;
for (int oh = min((h + ph) / sh, Ho - 1); oh >= 0 && h + ph - oh * sh < kh; --oh)
    for (int ow = min((w + pw) / sw, Wo - 1); ow >= 0 && w + pw - ow * sw < kw; --ow) {
        int o = ((n * Ho + oh) * Wo + ow) * C + c;
        float share = HPCDL_ROUND(__fdiv_rn(HPCDL_LOAD(dy[o]), ties[o]));
        float part = __fmul_rn(HPCDL_LOAD(x) == HPCDL_LOAD(y[o]) ? 1.0f : 0.0f, share);
        acc = tiled ? part : HPCDL_ROUND(__fadd_rn(acc, part));
    }
dx = HPCDL_STORE(acc);
"""

_CUPY_KERNELS: dict[str, tuple[Any, Any]] = {}  # per format, built on first use: needs a GPU
_USABLE: dict[str, bool] = {}  # per format: whether its kernels compiled and ran


def kernel_sources(fmt: str | None) -> tuple[tuple[str, str, str], tuple[str, str, str]]:
    """(in_params, out_params, body) of the forward and the backward kernel for float32 (fmt
    None) or a half format's uint16 bits; they are built with half_bits.preamble(fmt)."""
    held = "float32" if fmt is None else "uint16"
    forward = (f"raw {held} x, {_GEOMETRY}", f"{held} y, float32 ties", _FORWARD)
    backward = (
        f"{held} x, raw {held} y, raw float32 ties, raw {held} dy, bool tiled, {_GEOMETRY}",
        f"{held} dx",
        _BACKWARD,
    )
    return forward, backward


def _kernels(cp: Any, fmt: str | None) -> tuple[Any, Any]:
    """(forward, backward) CuPy kernels for float32 (fmt None) or a half format."""
    key = fmt or "fp32"
    if key not in _CUPY_KERNELS:
        forward, backward = (
            cp.ElementwiseKernel(*source, f"hpcdl_maxpool_{part}_{key}", preamble=preamble(fmt))
            for part, source in zip(("fwd", "bwd"), kernel_sources(fmt), strict=True)
        )
        _CUPY_KERNELS[key] = (forward, backward)
    return _CUPY_KERNELS[key]


def _usable(xp: Any, x: Any) -> bool:
    """Whether the kernels for x's format build and run (tried once, on a 1x1 pool of one
    element of x); when they do not, MaxPool2d runs its own code, said once."""
    fmt = format_of(x.dtype)
    key = fmt or "fp32"
    if key not in _USABLE:
        try:
            forward, backward = _kernels(xp, fmt)
            one = xp.ascontiguousarray(x[:1, :1, :1, :1])
            y, ties, dx = xp.empty_like(one), xp.empty(one.shape, np.float32), xp.empty_like(one)
            geo = (1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0)
            forward(_held(one), *geo, _held(y), ties)
            backward(_held(one), _held(y), ties, _held(one), True, *geo, _held(dx))
            _USABLE[key] = True
        except Exception as exc:  # noqa: BLE001 - any failure: the layer's own code runs
            _USABLE[key] = False
            say_once(f"maxpool-{key}", f"max-pool kernel off in {x.dtype} ({exc}); "
                     "MaxPool2d runs its own code")  # fmt: skip
    return _USABLE[key]


def geometry(layer: Any, x_shape: tuple[int, ...]) -> tuple[int, ...]:
    """(H, W, C, Ho, Wo, kh, kw, sh, sw, ph, pw) of the pool on an (N, H, W, C) input."""
    _, h, w, c = x_shape
    ho = (h + 2 * layer.ph - layer.kh) // layer.sh + 1
    wo = (w + 2 * layer.pw - layer.kw) // layer.sw + 1
    return (h, w, c, ho, wo, layer.kh, layer.kw, layer.sh, layer.sw, layer.ph, layer.pw)


def _held(array: Any) -> Any:
    """What the kernels take for an array: itself (float32) or its uint16 bits (half)."""
    return array if format_of(array.dtype) is None else bits(array)


class CupyMaxPool:
    """MaxPool2d on CuPy (N, H, W, C) float32, bf16 or fp16: one forward and one backward
    kernel."""

    name = "cupy-maxpool"

    def applies(self, layer: Any, x: Any) -> bool:
        taken = x.dtype == np.float32 or format_of(x.dtype) is not None
        xp = array_module(x)
        return xp is not np and taken and x.flags.c_contiguous and _usable(xp, x)

    def forward(self, layer: Any, x: Any, train: bool) -> Any:
        xp = array_module(x)
        geo = geometry(layer, x.shape)
        if geo[3] < 1 or geo[4] < 1:
            raise ValueError(f"MaxPool2d {layer.kh}x{layer.kw} does not fit input shape {x.shape}")
        forward, _ = _kernels(xp, format_of(x.dtype))
        y = xp.empty((x.shape[0], geo[3], geo[4], x.shape[3]), x.dtype)
        ties = xp.empty(y.shape, np.float32)
        forward(_held(x), *geo, _held(y), ties)
        layer.x, layer.y, layer.ties = x, y, ties
        return y

    def backward(self, layer: Any, dy: Any) -> Any:
        xp = array_module(dy)
        x = layer.x
        geo = geometry(layer, x.shape)
        _, backward = _kernels(xp, format_of(x.dtype))
        dx = xp.empty_like(x)
        dy = xp.ascontiguousarray(dy, dtype=x.dtype)
        backward(_held(x), _held(layer.y), layer.ties, _held(dy), layer.tiled, *geo, _held(dx))
        layer.x = layer.y = layer.ties = None
        return dx


KERNELS: list[Any] = [CupyMaxPool()]
