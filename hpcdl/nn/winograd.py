"""Winograd F(2x2, 3x3) for 3x3 stride-1 convolutions on channels-last NumPy arrays.

Forward, per 4x4 input tile d (stride 2 over the padded input) and 2x2 output tile y:

    y = A^T [ (G g G^T) . (B^T d B) ] A        U = G g G^T,  V = B^T d B,  M = U . V

where g is the 3x3 kernel. Summed over input channels, each of the 16 tile positions is one
GEMM, so a chunk's forward is one stacked call (16, P, C_in) @ (16, C_in, C_out), P being the
chunk's tiles: 16 multiply-adds per 2x2 outputs and channel pair instead of im2col's 36.
Backward is the exact gradient of that forward:

    dM = A dY A^T,   dU = V^T dM  (summed over chunks),   dg = G^T dU G,
    dV = dM U^T,     dd = B dV B^T, added back into the overlapping input tiles.

Why the transforms are written the way they are: a NumPy operation on a view that picks every
other column of an (N, H, W, C) image runs an inner loop C elements long, and at C = 16 it
measured 6x slower per element than on contiguous rows (strided add of 2^18 float32: 210 us,
contiguous: 34 us). So no transform picks columns. Along W, B^T is applied to every column
position of the padded input at once (shifted slices of whole rows, contiguous), which computes
each tile's four values plus as many unused ones:

    planes[0][x] = d[x] - d[x+2]                      x = 2j: V[., 0] of tile j; x = 2j+1: V[., 3]
    planes[1][x] = d[x+1] + d[x+2] (x even),          x = 2j: V[., 1];           x = 2j+1: V[., 2]
                   d[x+1] - d[x]   (x odd)

and along H the rows of those planes are combined (whole rows again). The GEMMs read each tile
position as a view with a row stride of 2 C (BLAS takes any row stride). The tile position
order inside this module is therefore (k, p) = (plane, parity): B^T's rows 0, 3, 1, 2
(POSITION_ORDER); U, dU and M use it. Odd output sizes take one more tile row or column: the
input is zero-padded to (2 th + 2, 2 tw + 2) and the extra outputs are cropped.

The functions write into arrays the caller owns (hpcdl.nn.conv keeps them as reused per-chunk
workspaces, handed out by a `scratch(name, shape)` callable); none keeps a reference.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import Any

import numpy as np

Scratch = Callable[[str, tuple[int, ...]], Any]  # (name, shape) -> a reusable work array

# G (4, 3): the kernel transform of F(2x2, 3x3). B^T and A^T are applied as additions.
KERNEL_TRANSFORM = np.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0.0, 0.0, 1.0]])
# The B^T row (tile column position) held at each (plane, parity) slot, in slot order.
POSITION_ORDER = (0, 3, 1, 2)
_STANDARD_ORDER = np.argsort(POSITION_ORDER)  # slot of each B^T row
# Elements of NumPy's ufunc buffer while the transforms run (its default is 8192). An operation
# on a non-contiguous view whose rows are shorter than the buffer is buffered row by row, and
# rows of 512 elements (a 32x32 layer's 2tw*C at 16 channels) then ran 2.5x slower than
# contiguous ones; with 512 only 1.7x. Measured on the 2-core EPYC, one thread, fwd + bwd ms of
# 64 images by buffer size: 16->16 32x32 8192: 20.0, 512: 16.3; 64->64 8x8 9.1 / 8.2.
UFUNC_BUFFER = 512


def tiles(ho: int, wo: int) -> tuple[int, int]:
    """Output tiles (th, tw) of 2x2 covering an (ho, wo) output; the last may stick out."""
    return -(-ho // 2), -(-wo // 2)


def padded_hw(ho: int, wo: int) -> tuple[int, int]:
    """(H, W) of the padded input the tiles read: 4x4 tiles at stride 2."""
    th, tw = tiles(ho, wo)
    return 2 * th + 2, 2 * tw + 2


def transform_weight(w: Any) -> Any:
    """U = G g G^T for a (3, 3, C_in, C_out) kernel: (16, C_in, C_out), contiguous, rows of the
    tile in order and columns in POSITION_ORDER."""
    g = KERNEL_TRANSFORM.astype(w.dtype)
    along_h = np.matmul(g, w.reshape(3, -1)).reshape(4, 3, -1)  # (4, 3, C_in*C_out)
    u = np.matmul(g[list(POSITION_ORDER)], along_h)  # (4, 4, C_in*C_out)
    return u.reshape(16, *w.shape[2:])


def input_grad_weight(u: Any) -> Any:
    """U^T per position, (16, C_out, C_in), contiguous, with the sign that backward_tiles's dM
    needs at B^T row 3 (it reads -dM there: see _output_grad_planes)."""
    u_t = np.ascontiguousarray(u.transpose(0, 2, 1)).reshape(4, 4, *u.shape[2:0:-1])
    u_t[:, POSITION_ORDER.index(3)] *= -1
    return u_t.reshape(16, *u.shape[2:0:-1])


def weight_grad(du: Any, out: Any) -> None:
    """out (3, 3, C_in, C_out) = G^T dU G, dU (16, C_in, C_out) summed over the batch."""
    g_t = KERNEL_TRANSFORM.T.astype(du.dtype)
    du_standard = du.reshape(4, 4, -1)[:, _STANDARD_ORDER]  # columns back in B^T row order
    along_h = np.matmul(g_t, du_standard.reshape(4, -1)).reshape(3, 4, -1)
    np.matmul(g_t, along_h, out=out.reshape(3, 3, -1))


@contextmanager
def _small_ufunc_buffers() -> Iterator[None]:
    """NumPy's ufunc buffer size set to UFUNC_BUFFER elements for the calling thread."""
    before = np.setbufsize(UFUNC_BUFFER)
    try:
        yield
    finally:
        np.setbufsize(before)


@_small_ufunc_buffers()
def forward_tiles(xpad: Any, u: Any, y: Any, scratch: Scratch) -> None:
    """y (n, Ho, Wo, F) = the convolution of xpad (n, padded_hw(Ho, Wo), C) with U (16, C, F)."""
    n, ho, wo, f = y.shape
    th, tw = tiles(ho, wo)
    planes = _input_planes(xpad, th, tw, scratch)
    m = scratch("m", (4, 2, 2, n * th * tw, f))  # (tile row, plane, parity, tile, F)
    np.matmul(_positions(planes), u.reshape(4, 2, 2, *u.shape[1:]), out=m)
    row_sums = scratch("out_rows", (2, 2, 2, n * th * tw, f))
    _output_rows(m, row_sums)  # A^T along the tile's rows
    s = [row_sums[:, k, p] for k, p in ((0, 0), (1, 0), (1, 1), (0, 1))]  # B^T rows 0-3
    out = scratch("out_cols", (2, 2, n * th * tw, f))  # (column, row, tile, F)
    np.add(s[0], s[1], out=out[0])
    out[0] += s[2]
    np.subtract(s[1], s[2], out=out[1])
    out[1] -= s[3]
    whole_tiles = ho % 2 == 0 and wo % 2 == 0
    y_tiles = y if whole_tiles else scratch("y_tiles", (n, 2 * th, 2 * tw, f))
    out_tiles = out.reshape(2, 2, n, th, tw, f).transpose(1, 0, 2, 3, 4, 5)
    _tile_view(y_tiles)[...] = out_tiles  # the one copy that walks F-long runs
    if not whole_tiles:
        y[...] = y_tiles[:, :ho, :wo]


@_small_ufunc_buffers()
def backward_tiles(
    xpad: Any, dy: Any, u_t: Any, du: Any, dx_pad: Any | None, scratch: Scratch
) -> None:
    """The gradients of forward_tiles for dy (n, Ho, Wo, F).

    du (16, C, F) is written with this call's dU = V^T dM (weight_grad turns a sum of them into
    dW). dx_pad (n, padded_hw(Ho, Wo), C), when given, is written with the gradient of the
    padded input; u_t is input_grad_weight(U)."""
    n, ho, wo, f = dy.shape
    th, tw = tiles(ho, wo)
    c = xpad.shape[3]
    planes = _input_planes(xpad, th, tw, scratch)
    dy_tiles = dy
    if ho % 2 or wo % 2:  # one more tile row or column: its outputs' gradient is zero
        dy_tiles = scratch("y_tiles", (n, 2 * th, 2 * tw, f))
        dy_tiles[:, :ho, :wo] = dy
        dy_tiles[:, ho:] = 0
        dy_tiles[:, :, wo:] = 0
    dm = _output_grad_planes(dy_tiles, scratch)  # per plane: (4, 2, P, F) views
    v = _positions(planes)  # (4, 2, 2, P, C)
    du5 = du.reshape(4, 2, 2, c, f)
    for k in range(2):
        np.matmul(v[:, k].swapaxes(-1, -2), dm[k], out=du5[:, k])
    du5[:, 0, 1] *= -1  # dM at B^T row 3 is -(what dm[0] holds there)
    if dx_pad is None:
        return
    u_t5 = u_t.reshape(4, 2, 2, f, c)
    dv = scratch("dv", (2, 4, n, th, tw, 2, c))  # (plane, tile row, tiles, parity, C)
    for k in range(2):
        np.matmul(dm[k], u_t5[:, k], out=_positions_of_plane(dv[k]))
    _input_grad(dv, scratch, dx_pad)


def _input_planes(xpad: Any, th: int, tw: int, scratch: Scratch) -> Any:
    """B^T d B of every tile of xpad (n, 2th+2, 2tw+2, C) as planes (2, 4, n, th, 2tw, C):
    plane k, tile row a, column 2j + p holds tile j's value at B^T rows (a, POSITION_ORDER[2k+p]).
    """
    along_w = _input_along_w(xpad, scratch)
    planes = scratch("planes", (2, 4, xpad.shape[0], th, 2 * tw, xpad.shape[3]))
    rows = [along_w[:, :, a : a + 2 * th : 2, : 2 * tw] for a in range(4)]  # (2, n, th, 2tw, C)
    _input_rows(rows, planes.swapaxes(0, 1))  # B^T along H
    return planes


def _input_along_w(xpad: Any, scratch: Scratch) -> Any:
    """B^T along W at every column of xpad (n, Hp, Wp, C): (2, n, Hp, Wp, C), the planes of the
    module docstring; the last two columns of each row are left unused.

    Computed on the flat arrays (shifts by C and 2C elements), so every operation runs over
    contiguous memory; a shift that crosses a row end lands only in the unused columns."""
    flat, c = xpad.reshape(-1), xpad.shape[3]
    cut = flat.size - 2 * c
    along_w = scratch("along_w", (2, *xpad.shape))
    diff, mixed = along_w[0].reshape(-1)[:cut], along_w[1].reshape(-1)[:cut]
    even, odd = _parity_masks(xpad.shape, xpad.dtype)
    np.subtract(flat[:cut], flat[2 * c :], out=diff)
    np.multiply(flat[2 * c :], even[:cut], out=mixed)
    mixed += flat[c : cut + c]
    odd_part = scratch("odd_part", (cut,))
    np.multiply(flat[:cut], odd[:cut], out=odd_part)
    mixed -= odd_part
    return along_w


def _positions(planes: Any) -> Any:
    """planes (2, 4, n, th, 2tw, C) as the GEMM operand (4, 2, 2, P, C): (tile row, plane,
    parity, tile, C), each (P, C) a view with row stride 2C."""
    two, four, n, th, width, c = planes.shape
    pairs = planes.reshape(two, four, n, th, width // 2, 2, c)
    return _merged(pairs.transpose(1, 0, 5, 2, 3, 4, 6), (four, two, 2, -1, c))


def _positions_of_plane(plane: Any) -> Any:
    """One plane (4, n, th, 2tw, C) or (4, n, th, tw, 2, C) as (4, 2, P, C) views."""
    four, n, th = plane.shape[:3]
    c = plane.shape[-1]
    pairs = plane.reshape(four, n, th, -1, 2, c)
    return _merged(pairs.transpose(0, 4, 1, 2, 3, 5), (four, 2, -1, c))


def _merged(view: Any, shape: tuple[int, ...]) -> Any:
    """view reshaped without a copy (raises if that needs one)."""
    out = view.view()
    out.shape = shape
    return out


@lru_cache(maxsize=32)
def _parity_masks(shape: tuple[int, ...], dtype: Any) -> tuple[Any, Any]:
    """(even, odd): flat arrays the size of an (n, H, W, C) array, 1 at even (odd) columns W
    and 0 elsewhere, read-only."""
    n, h, w, c = shape
    even = np.zeros((n * h, w, c), dtype=dtype)
    even[:, 0::2] = 1
    odd = 1 - even
    even.flags.writeable = odd.flags.writeable = False
    return even.reshape(-1), odd.reshape(-1)


def _input_rows(d: list[Any], out: Any) -> None:
    """out[i] = (B^T d)[i] for the four rows d[0..3] of a tile (any shape, elementwise)."""
    np.subtract(d[0], d[2], out=out[0])
    np.add(d[1], d[2], out=out[1])
    np.subtract(d[2], d[1], out=out[2])
    np.subtract(d[1], d[3], out=out[3])


def _output_rows(m: Any, out: Any) -> None:
    """out[0] = m0 + m1 + m2, out[1] = m1 - m2 - m3: A^T over the first axis of m (4, ...)."""
    np.add(m[0], m[1], out=out[0])
    out[0] += m[2]
    np.subtract(m[1], m[2], out=out[1])
    out[1] -= m[3]


def _output_grad_planes(dy: Any, scratch: Scratch) -> list[Any]:
    """dM = A dY A^T of every tile of dy (n, 2th, 2tw, F), as two (4, 2, P, F) views.

    Along H, A's rows are combined (whole rows); along W, sums and differences of neighbouring
    columns are taken at every column: [0] holds B^T rows 0 and 3 (3 negated: -dY's odd
    column), [1] rows 1 and 2 (the sum and the difference at even columns)."""
    n, h2, w2, f = dy.shape
    rows = scratch("dm_rows", (4, n, h2 // 2, w2, f))
    r0, r1 = dy[:, 0::2], dy[:, 1::2]
    rows[0] = r0
    np.add(r0, r1, out=rows[1])
    np.subtract(r0, r1, out=rows[2])
    np.negative(r1, out=rows[3])
    sums = scratch("dm_sums", (2, 4, n, h2 // 2, w2, f))  # odd columns unused
    flat, cut = rows.reshape(-1), rows.size - f
    np.add(flat[:cut], flat[f:], out=sums[0].reshape(-1)[:cut])
    np.subtract(flat[:cut], flat[f:], out=sums[1].reshape(-1)[:cut])
    even_sums = sums.reshape(2, 4, n, h2 // 2, w2 // 2, 2, f)[..., 0, :]
    at_rows = _merged(even_sums.transpose(1, 0, 2, 3, 4, 5), (4, 2, -1, f))
    return [_positions_of_plane(rows), at_rows]


def _input_grad(dv: Any, scratch: Scratch, dx: Any) -> None:
    """dx (n, 2th+2, 2tw+2, C) = the transpose of _input_planes applied to dv, the planes'
    gradient (2, 4, n, th, tw, 2, C); dv is overwritten."""
    two, four, n, th, tw = dv.shape[:5]
    c = dv.shape[-1]
    planes = dv.reshape(two, four, n, th, 2 * tw, c)
    along_h = planes.swapaxes(0, 1)  # (4, 2, n, th, 2tw, C)
    _input_grad_rows(along_h, scratch("rows_scratch", along_h[0].shape))  # B along H
    along_w = scratch("along_w", (2, *dx.shape))
    row_pairs = along_w.reshape(2, n, th + 1, 2, *dx.shape[2:])[..., : 2 * tw, :]
    _overlap_add(along_h, row_pairs, axis=2)
    along_w[..., 2 * tw :, :] = 0  # the unused columns: the flat shifts below read them
    _input_grad_along_w(along_w, dx, scratch)


def _input_grad_along_w(along_w: Any, dx: Any, scratch: Scratch) -> None:
    """dx (n, Hp, Wp, C) = the transpose of _input_along_w applied to along_w (2, n, Hp, Wp, C),
    whose unused columns are zero; on flat arrays, as there."""
    diff, mixed, out = along_w[0].reshape(-1), along_w[1].reshape(-1), dx.reshape(-1)
    c = dx.shape[3]
    cut = out.size - 2 * c
    even, odd = _parity_masks(dx.shape, dx.dtype)
    part = scratch("odd_part", (out.size,))
    np.multiply(mixed, odd, out=part)
    np.subtract(diff, part, out=out)
    out[c:] += mixed[:-c]
    np.multiply(mixed[:cut], even[:cut], out=part[:cut])
    part[:cut] -= diff[:cut]
    out[2 * c :] += part[:cut]


def _input_grad_rows(d: Any, scratch: Any) -> None:
    """d = B d over the first axis of d (4, ...), in place (B is B^T's transpose)."""
    np.subtract(d[1], d[2], out=scratch)
    d[2] += d[1]
    d[2] -= d[0]
    np.add(scratch, d[3], out=d[1])
    np.negative(d[3], out=d[3])


def _overlap_add(parts: Any, out: Any, axis: int) -> None:
    """out = parts (4, ...) placed at tiles 2 apart: out is split (tiles + 1, 2) at `axis` and
    axis + 1; parts[0:2] go to pair t of tile t, parts[2:4] are added to pair t + 1."""
    count = parts.shape[axis + 1]
    lead = (slice(None),) * axis
    np.moveaxis(out[(*lead, slice(0, count))], axis + 1, 0)[...] = parts[0:2]
    out[(*lead, count)] = 0
    np.moveaxis(out[(*lead, slice(1, count + 1))], axis + 1, 0)[...] += parts[2:4]


def _tile_view(y: Any) -> Any:
    """(n, 2th, 2tw, F) as (2, 2, n, th, tw, F): [r, s] is output (2i + r, 2j + s) of tile i, j."""
    n, h, w, f = y.shape
    return y.reshape(n, h // 2, 2, w // 2, 2, f).transpose(2, 4, 0, 1, 3, 5)
