"""Conv2d's Winograd path: which layers take it, and its forward and backward over chunks.

The arithmetic (transforms, tiles, the stacked GEMMs) is hpcdl.nn.winograd; this module runs it
chunk by chunk with Conv2d's workspaces and chunk threads (hpcdl.nn.conv's module docstring).
The dependency runs one way: hpcdl.nn.conv calls this module, and this module knows the layer
only as a ChunkedConv (the attributes and workspace methods it uses), never importing conv.

On the chunked path (hpcdl.nn.conv), a 3x3 stride-1 layer with
enough channels computes F(2x2, 3x3) instead: 16 multiply-adds per 2x2 outputs and channel
pair instead of im2col's 36, as one stacked GEMM per chunk over the 16 tile positions, plus
input and output transforms of a few additions per element. The transforms cost about what
the im2col copy does, so Winograd wins only where the GEMM dominates, i.e. with many channels:
on one chunk thread, 2-40% less time from 32 channels on, 6% more at 16 and 75% more at 3.
On two chunk threads its transforms scale 1.4x where im2col scales 1.75x, so there it is
taken only from 64 channels on maps of 14x14 or more (resnet18's layers at 224: 16-29% less),
not for CIFAR's 8x8-16x16 layers. The measured numbers are in the comment of
WINOGRAD_MIN_CHANNELS. U = G g G^T is computed once per forward and reused by backward, which
is the exact gradient of the transformed forward: results differ from im2col's by float
rounding only (about 1e-15 relative in float64). dU is summed per slot in chunk order and the
slots in slot order, so steps repeat bitwise. Padding 0 and 1 and odd output sizes all take
it (one more tile row or column, cropped). The whole-batch path and CuPy keep im2col.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from hpcdl import backend
from hpcdl.nn import winograd

# When a 3x3 stride-1 layer takes the Winograd path (module docstring): with at least
# WINOGRAD_MIN_CHANNELS channels (the fewer of C_in and C_out) on one chunk thread; with more
# chunk threads (compute_threads()), only with WINOGRAD_THREADED_MIN_CHANNELS channels and an
# output of WINOGRAD_THREADED_MIN_SIZE rows and columns or more. Measured on the 2-core EPYC,
# float32, one BLAS thread, fwd + bwd ms im2col / Winograd, the two alternated in one process
# (docs/bench-scripts/issue12/winograd/ab_layers.py, scal2.py, ab_big.py; load 0.1-0.7):
# - one chunk thread, batch 64: resnet20's 3->16 32x32 3.6 / 6.4, 16->16 32x32 14.9 / 15.9,
#   32->32 16x16 11.4 / 9.8, 64->64 8x8 10.1 / 8.9; cnn's 32->32 valid 32x32 41.0 / 33.0,
#   32->64 15x15 20.5 / 16.2, 64->64 valid 15x15 28.7 / 24.6. Batch 8 (resnet18 at 224):
#   64->64 56x56 62.7 / 46.0, 128->128 28x28 59.5 / 36.1, 256->256 14x14 59.4 / 39.7,
#   512->512 7x7 78.4 / 76.7.
# - two chunk threads, idle machine: batch 64, 32->32 16x16 6.3 / 7.5, 64->64 8x8 5.7 / 6.3
#   (Winograd's transforms scale 1.4x on two cores where im2col scales 1.75x); batch 8, 64->64
#   56x56 35.8 / 30.1, 128->128 28x28 33.3 / 23.8, 256->256 14x14 33.4 / 27.5, 512->512 7x7
#   44.6 / 51.5.
WINOGRAD_MIN_CHANNELS = 32
WINOGRAD_THREADED_MIN_CHANNELS = 64
WINOGRAD_THREADED_MIN_SIZE = 14
# Bytes of Winograd-transformed input tiles per chunk (16 values per 2x2 outputs, at the wider
# of C_in and C_out). Measured as above, fwd + bwd ms of the 32->32 16x16 / 64->64 8x8 layers
# at 0.25, 0.5, 1, 2 MiB: 12.9 / 8.9, 11.4 / 7.8, 10.8 / 9.0, 12.7 / 10.6.
WINOGRAD_CHUNK_BYTES = 1 << 20


class ChunkedConv(Protocol):
    """What the Winograd path uses of a convolution layer (hpcdl.nn.conv.Conv2d is one)."""

    kh: int
    kw: int
    sh: int
    sw: int
    ph: int
    pw: int
    c_in: int
    c_out: int
    has_bias: bool
    input_grad: bool
    p: dict[str, Any]  # parameter views: "W" (3, 3, C_in, C_out), "b" (C_out,)
    g: dict[str, Any]  # gradient views, same names and shapes
    x_shape: tuple[int, ...]  # (N, H, W, C_in) of the last forward
    chunk: int  # images per chunk in the last forward
    x_pad: Any  # the padded input of the last forward, kept for backward
    winograd_u: Any  # G g G^T of the last forward, (16, C_in, C_out)
    _buffers: Any  # the layer's reused workspaces (hpcdl.nn.workspace.Workspaces)

    def output_hw(self, h: int, w: int) -> tuple[int, int]: ...

    def _run_chunks(self, work: Callable[[int, int, int, bool], None], n: int) -> int: ...

    def _workspace(self, name, shape=None, dtype=None, xp=None, zeroed=False, fill=None) -> Any: ...

    def _slot_ws(self, name: str, like: Any, slot: int) -> Any: ...

    def _tiled(self, name: str, vec: Any, reps: int, xp: Any) -> Any: ...


def applies(conv: ChunkedConv, x: Any) -> bool:
    """Whether conv.forward(x) takes the Winograd path: a 3x3 stride-1 layer of a size where it
    measured faster (WINOGRAD_MIN_CHANNELS and the constants after it), on the
    one-BLAS-thread NumPy (chunked) path."""
    if backend.blas_threads() != 1 or backend.is_device_array(x) or x.dtype.itemsize == 2:
        return False  # real half arrays (hpcdl.nn.dtypes) take im2col
    if (conv.kh, conv.kw, conv.sh, conv.sw) != (3, 3, 1, 1):
        return False
    channels = min(conv.c_in, conv.c_out)
    if backend.compute_threads() == 1:
        return channels >= WINOGRAD_MIN_CHANNELS
    size = min(conv.output_hw(x.shape[1], x.shape[2]))
    return channels >= WINOGRAD_THREADED_MIN_CHANNELS and size >= WINOGRAD_THREADED_MIN_SIZE


def chunk_images(conv: ChunkedConv, x: Any) -> int:
    """Images per chunk on the Winograd path: WINOGRAD_CHUNK_BYTES of transformed tiles."""
    n, h, w, _ = x.shape
    th, tw = winograd.tiles(*conv.output_hw(h, w))
    image_bytes = 16 * th * tw * max(conv.c_in, conv.c_out) * x.dtype.itemsize
    return min(n, max(1, WINOGRAD_CHUNK_BYTES // image_bytes))


def forward(conv: ChunkedConv, x: Any) -> Any:
    """conv.forward(x) by Winograd F(2x2, 3x3) (hpcdl.nn.winograd), chunks as on im2col's path."""
    n, h, w, c = x.shape
    ho, wo = conv.output_hw(h, w)
    conv.x_shape, conv.chunk = x.shape, chunk_images(conv, x)
    hp, wp = winograd.padded_hw(ho, wo)
    xpad = x
    if (hp, wp) != (h, w):  # the border stays zero: only the interior is ever written
        xpad = conv._workspace("x_pad", (n, hp, wp, c), x.dtype, np, zeroed=True)
        xpad[:, conv.ph : conv.ph + h, conv.pw : conv.pw + w, :] = x
    conv.x_pad = xpad
    conv.winograd_u = winograd.transform_weight(conv.p["W"])  # reused by backward
    y = np.empty((n, ho, wo, conv.c_out), dtype=x.dtype)
    b_row = conv._tiled("b_row", conv.p["b"], wo, np) if conv.has_bias else None

    def forward_chunk(first: int, count: int, slot: int, fresh: bool) -> None:
        images = slice(first, first + count)
        scratch = _scratch(conv, slot, x.dtype)
        winograd.forward_tiles(xpad[images], conv.winograd_u, y[images], scratch)
        if b_row is not None:
            y2 = y[images].reshape(count * ho, wo * conv.c_out)
            y2 += b_row

    conv._run_chunks(forward_chunk, n)
    return y  # (N, Ho, Wo, C_out)


def backward(conv: ChunkedConv, dy: Any) -> Any:
    """conv.backward: dW (db is the caller's) and dx of the Winograd forward; returns dx or None.

    Each slot sums its chunks' dU in chunk order, the slots' sums are added in slot order,
    and dW = G^T dU G once: the same bits every step for a given thread count."""
    _, h, w, c = conv.x_shape
    hp, wp = conv.x_pad.shape[1:3]
    dx = u_t = None
    if conv.input_grad:
        dx = np.empty(conv.x_shape, dtype=dy.dtype)
        u_t = winograd.input_grad_weight(conv.winograd_u)  # (16, C_out, C_in)

    def backward_chunk(first: int, count: int, slot: int, fresh: bool) -> None:
        images = slice(first, first + count)
        scratch = _scratch(conv, slot, dy.dtype)
        total = conv._slot_ws("dU_sum", conv.winograd_u, slot)
        part = total if fresh else conv._slot_ws("dU", conv.winograd_u, slot)
        dx_pad = None if dx is None else scratch("dx_pad", (count, hp, wp, c))
        winograd.backward_tiles(conv.x_pad[images], dy[images], u_t, part, dx_pad, scratch)
        if not fresh:
            total += part
        if dx is not None:
            dx[images] = dx_pad[:, conv.ph : conv.ph + h, conv.pw : conv.pw + w]

    slots = conv._run_chunks(backward_chunk, dy.shape[0])
    du = conv._slot_ws("dU_sum", conv.winograd_u, 0)
    for slot in range(1, slots):  # in slot order: the same sum every step and on every rank
        du += conv._slot_ws("dU_sum", conv.winograd_u, slot)
    winograd.weight_grad(du, conv.g["W"])
    conv.x_pad = None
    return dx


def _scratch(conv: ChunkedConv, slot: int, dtype: Any) -> winograd.Scratch:
    """scratch(name, shape) for the Winograd functions: per-slot arrays, one flat buffer per
    name grown to the largest shape asked for (a chunk's), so smaller chunks reuse it."""

    def scratch(name: str, shape: tuple[int, ...]) -> Any:
        return conv._buffers.at_least(f"winograd_{name}:{slot}", shape, dtype, np)

    return scratch
