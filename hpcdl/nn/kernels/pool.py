"""Fast kernels for MaxPool2d (NOTE [fast kernels] in hpcdl/nn/kernels/__init__.py).

CupyMaxPool: forward and backward as CuPy ElementwiseKernels on float32 NHWC, no padded copy.
Forward writes, per output, the maximum and how many window elements equal it (`ties`, what the
reference counts in backward); backward gathers, per input element, the windows that hold it,
in the reference's order (window offsets (i, j) ascending), each giving dy / ties where the
element is its window's maximum: the reference's equal sharing of tied maxima (after a ReLU a
window of zeros is common), which an arg-max index alone would not give. Every product and sum
is rounded on its own (__fmul_rn, __fadd_rn: no FMA), so the bits are the reference's.

`gather_backward` is that backward's loop in NumPy, element for element; the CPU test checks it
against MaxPool2d.backward bit for bit, and a `gpu` test the kernels themselves.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hpcdl.backend import array_module

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
    float v = x[((n * H + h) * W + w) * C + c];
    if (isnan(v) || v > m) m = isnan(m) ? m : v;
}
float count = 0.0f;
for (int a = 0; a < kh; ++a) for (int b = 0; b < kw; ++b) {
    int h = oh * sh - ph + a, w = ow * sw - pw + b;
    if (h < 0 || h >= H || w < 0 || w >= W) continue;
    if (x[((n * H + h) * W + w) * C + c] == m) count = __fadd_rn(count, 1.0f);
}
y = m; ties = count;
"""

_BACKWARD = """
int c = i % C, w = (i / C) % W, h = (i / (C * W)) % H, n = i / (C * W * H);
float acc = 0.0f;
for (int oh = min((h + ph) / sh, Ho - 1); oh >= 0 && h + ph - oh * sh < kh; --oh)
    for (int ow = min((w + pw) / sw, Wo - 1); ow >= 0 && w + pw - ow * sw < kw; --ow) {
        int o = ((n * Ho + oh) * Wo + ow) * C + c;
        float share = dy[o] / ties[o];
        float part = __fmul_rn(x == y[o] ? 1.0f : 0.0f, share);
        acc = tiled ? part : __fadd_rn(acc, part);
    }
dx = acc;
"""

_CUPY_KERNELS: dict[str, Any] = {}  # built on first use: compiling needs a GPU


def _kernels(cp: Any) -> tuple[Any, Any]:
    if not _CUPY_KERNELS:
        _CUPY_KERNELS["forward"] = cp.ElementwiseKernel(
            f"raw float32 x, {_GEOMETRY}", "float32 y, float32 ties", _FORWARD, "hpcdl_maxpool_fwd"
        )
        _CUPY_KERNELS["backward"] = cp.ElementwiseKernel(
            f"float32 x, raw float32 y, raw float32 ties, raw float32 dy, bool tiled, {_GEOMETRY}",
            "float32 dx",
            _BACKWARD,
            "hpcdl_maxpool_bwd",
        )
    return _CUPY_KERNELS["forward"], _CUPY_KERNELS["backward"]


def geometry(layer: Any, x_shape: tuple[int, ...]) -> tuple[int, ...]:
    """(H, W, C, Ho, Wo, kh, kw, sh, sw, ph, pw) of the pool on an (N, H, W, C) input."""
    _, h, w, c = x_shape
    ho = (h + 2 * layer.ph - layer.kh) // layer.sh + 1
    wo = (w + 2 * layer.pw - layer.kw) // layer.sw + 1
    return (h, w, c, ho, wo, layer.kh, layer.kw, layer.sh, layer.sw, layer.ph, layer.pw)


def gather_backward(x: Any, y: Any, ties: Any, dy: Any, tiled: bool, geo: tuple) -> Any:
    """The backward kernel's loop in NumPy float32 (per input element, its windows in the
    reference's order): the arithmetic the CUDA encodes, for the CPU test."""
    h_in, w_in, _, ho, wo, kh, kw, sh, sw, ph, pw = geo
    dx = np.zeros_like(x)
    for h in range(h_in):
        for w in range(w_in):
            acc = np.zeros_like(x[:, 0, 0])
            for oh in range(min((h + ph) // sh, ho - 1), -1, -1):
                if h + ph - oh * sh >= kh:
                    break
                for ow in range(min((w + pw) // sw, wo - 1), -1, -1):
                    if w + pw - ow * sw >= kw:
                        break
                    share = dy[:, oh, ow] / ties[:, oh, ow]
                    part = (x[:, h, w] == y[:, oh, ow]).astype(np.float32) * share
                    acc = part if tiled else acc + part
            dx[:, h, w] = acc
    return dx


class CupyMaxPool:
    """MaxPool2d on CuPy float32 (N, H, W, C): one forward and one backward kernel."""

    name = "cupy-maxpool"

    def applies(self, layer: Any, x: Any) -> bool:
        return array_module(x) is not np and x.dtype == np.float32 and x.flags.c_contiguous

    def forward(self, layer: Any, x: Any, train: bool) -> Any:
        xp = array_module(x)
        geo = geometry(layer, x.shape)
        if geo[3] < 1 or geo[4] < 1:
            raise ValueError(f"MaxPool2d {layer.kh}x{layer.kw} does not fit input shape {x.shape}")
        forward, _ = _kernels(xp)
        y = xp.empty((x.shape[0], geo[3], geo[4], x.shape[3]), np.float32)
        ties = xp.empty_like(y)
        forward(x, *geo, y, ties)
        layer.x, layer.y, layer.ties = x, y, ties
        return y

    def backward(self, layer: Any, dy: Any) -> Any:
        xp = array_module(dy)
        x = layer.x
        geo = geometry(layer, x.shape)
        _, backward = _kernels(xp)
        dx = xp.empty_like(x)
        dy = xp.ascontiguousarray(dy, dtype=np.float32)
        backward(x, layer.y, layer.ties, dy, layer.tiled, *geo, dx)
        layer.x = layer.y = layer.ties = None
        return dx


KERNELS: list[Any] = [CupyMaxPool()]
