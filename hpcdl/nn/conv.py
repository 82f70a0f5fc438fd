"""2-D convolution on channels-last activations via im2col + one contiguous GEMM.

Layout (why it is fast): x is (N, H, W, C) and the weight is (kh, kw, C_in, C_out). The im2col
matrix is (N*Ho*Wo, kh*kw*C_in) with rows in output order, so

    forward   y    = cols @ W            -> (N*Ho*Wo, C_out), already (N, Ho, Wo, C_out)
    backward  dW   = cols.T @ dy         (written straight into the flat gradient buffer)

are single BLAS calls on contiguous 2-D arrays, and neither the output nor the input gradient
needs a transpose. The im2col matrix is kept per layer and reused between steps while the input
shape stays the same, which saves a page-faulting allocation per step.

The input gradient has two equivalent forms, chosen per layer by measured cost (docs/nn.md):
- dilated: im2col of dy scattered into a zero grid, then one GEMM with the flipped kernel,
  (N*H*W, kh*kw*C_out) @ (kh*kw*C_out, C_in). Its GEMM is as large as the forward's at stride 1
  but runs over every input position, so at stride 2 three quarters of its work multiplies zeros.
- col2im: dcols = dy @ W.T, (N*Ho*Wo, C_out) @ (C_out, kh*kw*C_in), then kh*kw strided adds
  into dx. Its GEMM is wide and its work scales with the output positions, but each add's inner
  loop is only C_in long. On the 2-core EPYC at batch 64 (OpenBLAS, one thread) it takes
  4.8 ms instead of 19 ms for resnet20's 16->32 stride-2 layer and 8.5 instead of 10.6 ms for
  cnn's 32->64 layer, but 25 ms instead of 11 ms for a 16->16 stride-1 layer: col2im is used
  when the stride is > 1 or the layer widens (C_out > C_in).

Chunks (when NumPy's BLAS runs one thread, hpcdl.backend.blas_threads() == 1): the whole-batch
im2col matrix is tens of MB, so the GEMM reads it back from memory after the copy wrote it
there. Instead, images are taken a few at a time (CHUNK_BYTES of columns, about L2-sized, and
at least MIN_CHUNK_MACS of work): each chunk's columns are formed in a reused chunk workspace
and consumed by its GEMM while still in cache, writing that chunk's output rows. Backward
forms each chunk's columns again from the padded input, adds its dW part in chunk order
(deterministic), and computes that chunk's input gradient. Each chunk GEMM is itself cut into
pieces that OpenBLAS multiplies without packing (SMALL_GEMM), in one stacked np.matmul call.
With several BLAS threads, or on the GPU, one whole-batch GEMM is faster (every small GEMM
pays a thread wake-up) and the whole-batch path is used.

Chunk threads (hpcdl.backend.compute_threads() = T > 1, set with the one BLAS thread by
hpcdl.comm.blas_threads.use_layer_threads): the chunks run on the T threads of the shared pool
in hpcdl.nn.threads, since NumPy releases the GIL in the im2col copy and in BLAS, and a
one-thread OpenBLAS may be called from several threads. Thread t takes chunks t, t+T, ...
with its own workspaces and its own dW sum; the sums are added in thread order, so a step's
results repeat bitwise. On 2 cores this is 0.6-0.8x the time of whole-batch GEMMs on a
2-thread BLAS (docs/PERFORMANCE.md).

Winograd F(2x2, 3x3) (hpcdl.nn.conv_winograd, hpcdl.nn.winograd): on the chunked path, a 3x3
stride-1 layer with enough channels takes Winograd's algorithm instead of im2col, where it
measured faster (conv_winograd.applies).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hpcdl import backend
from hpcdl.backend import array_module
from hpcdl.nn import conv_winograd
from hpcdl.nn.dtypes import matmul
from hpcdl.nn.kernels import Seam
from hpcdl.nn.layers import Layer, ParamSpec, _pair
from hpcdl.nn.threads import run_parts
from hpcdl.nn.workspace import Workspaces

# Bytes of im2col columns per chunk on the one-BLAS-thread path (module docstring): about the
# L2 cache of one core, so the GEMM reads the columns the copy just wrote from cache. Measured
# on the 2-core EPYC, batch 64, one thread, CPU ms per step for cnn / resnet20: 0.5 MB 134 /
# 328, 1 MB 130 / 309, 2 MB 129 / 321, 4 MB 138 / - (whole batch: 163 / 426).
CHUNK_BYTES = 1 << 20
# Multiply-adds of a chunk's forward GEMM at least: a narrower chunk pays more in per-chunk
# calls and thread hand-offs than its cache locality saves. Measured on the 2-core EPYC, two
# chunk threads, split GEMMs (SMALL_GEMM), fwd + bwd ms of resnet20's 16->16 32x32 layer
# (2.4M multiply-adds per image) by images per chunk: 1: 11.4-12.0, 2: 9.1-9.3, 3: 8.5-8.6,
# 4: 8.3-8.4, 6: 9.0-9.5.
MIN_CHUNK_MACS = 6_000_000

# OpenBLAS (0.3.31, SkylakeX kernels, the 2-core EPYC) multiplies without packing its operands
# when M*N*K <= 1e6 (its "small matrix" kernel). The chunked path splits its GEMMs into pieces
# of at most that size. Measured one thread, float32, GFLOPS blocked / one GEMM per 1024 rows:
# (K, N) = (144, 16) 106 / 76, (144, 32) 105 / 88, (288, 32) 104 / 80, (576, 64) 98 / 89,
# (27, 16) 98 / 94. Pieces shorter than MIN_BLOCK_ROWS rows pay more in calls than they save.
SMALL_GEMM = 1_000_000
MIN_BLOCK_ROWS = 16
# The weight gradient cols.T @ dy is split over K when blocks of at least MIN_K_BLOCK_...
# columns fit, else over rows (the block products are then added) when blocks of at least
# MIN_ROW_BLOCK_... rows fit, else left whole. Measured GFLOPS whole / over K / over rows (one
# thread, stacked calls): (K, N, rows) = (144, 16, 1024) 76 / 98 / 92, (288, 32, 768) 88 / 110
# / 99, (576, 64, 448) 97 / 109 / 86, (27, 16, 9216) 58 / 51 / 86.
MIN_ROW_BLOCK_WEIGHT_GRAD = 128
MIN_K_BLOCK_WEIGHT_GRAD = 32


class Conv2d(Layer):
    """Convolution with stride and zero padding on (N, H, W, C_in) -> (N, Ho, Wo, C_out).

    Initialisers (hpcdl.nn.init) default to PyTorch's nn.Conv2d: U(+-1/sqrt(kh*kw*C_in)) for both.
    """

    fresh_output = True

    def __init__(
        self,
        c_in: int,
        c_out: int,
        kernel: int | tuple[int, int] = 3,
        stride: int | tuple[int, int] = 1,
        padding: int | tuple[int, int] = 0,
        bias: bool = True,
        init: str = "torch_default",
        bias_init: str = "torch_default",
    ) -> None:
        super().__init__()
        self.c_in, self.c_out = c_in, c_out
        self.kh, self.kw = _pair(kernel)
        self.sh, self.sw = _pair(stride)
        self.ph, self.pw = _pair(padding)
        fan_in, fan_out = self.kh * self.kw * c_in, self.kh * self.kw * c_out
        specs = [ParamSpec("W", (self.kh, self.kw, c_in, c_out), init, fan_in, fan_out)]
        if bias:
            specs.insert(0, ParamSpec("b", (c_out,), bias_init, fan_in, fan_out, decay=False))
        self.param_specs = tuple(specs)
        self.has_bias = bias
        # Which input-gradient form backward uses (module docstring): col2im where measured
        # faster, i.e. when strided or widening; else the dilated form.
        self.col2im_input_grad = self.sh > 1 or self.sw > 1 or c_out > c_in
        self._buffers = Workspaces()  # reused workspaces (im2col matrices)
        self.seam = Seam("conv")  # fast kernels come first (hpcdl.nn.kernels)
        self.x_shape: tuple[int, ...] = ()  # (N, H, W, C_in) of the last forward
        self.x_dtype: Any = None  # its dtype: float32, or the format's with real half arrays
        self.chunk = 0  # images per chunk in the last forward; 0: one whole-batch GEMM
        self.x_pad: Any = None  # chunked: the padded input, (N, Hp, Wp, C_in), for backward
        self.winograd = False  # the last forward took the Winograd path (uses_winograd)
        self.winograd_u: Any = None  # Winograd: G g G^T of the last forward, (16, C_in, C_out)

    def output_hw(self, h: int, w: int) -> tuple[int, int]:
        ho = (h + 2 * self.ph - self.kh) // self.sh + 1
        wo = (w + 2 * self.pw - self.kw) // self.sw + 1
        return ho, wo

    def chunk_images(self, x: Any) -> int:
        """Images per im2col chunk for input x (N, H, W, C_in); 0 for one whole-batch GEMM."""
        if backend.blas_threads() != 1 or backend.is_device_array(x):
            return 0
        n, h, w, c = x.shape
        ho, wo = self.output_hw(h, w)
        image_bytes = ho * wo * self.kh * self.kw * c * x.dtype.itemsize
        image_macs = ho * wo * self.kh * self.kw * c * self.c_out
        images = max(1, CHUNK_BYTES // image_bytes, -(-MIN_CHUNK_MACS // image_macs))
        return 0 if images >= n else images

    def uses_winograd(self, x: Any) -> bool:
        """Whether forward(x) takes the Winograd path (hpcdl.nn.conv_winograd.applies)."""
        return conv_winograd.applies(self, x)

    def forward(self, x, train=True):
        xp = array_module(x)
        n, h, w, c = x.shape
        if c != self.c_in:
            raise ValueError(f"Conv2d expects {self.c_in} input channels, got shape {x.shape}")
        ho, wo = self.output_hw(h, w)
        if ho < 1 or wo < 1:
            raise ValueError(
                f"Conv2d kernel {self.kh}x{self.kw} does not fit input {h}x{w} "
                f"with padding {self.ph},{self.pw}"
            )
        if self.seam.take(self, x):
            return self.seam.kernel.forward(self, x, train)
        self.winograd = self.uses_winograd(x)
        if self.winograd:
            return conv_winograd.forward(self, x)
        xpad = x
        if self.ph or self.pw:  # the border stays zero: only the interior is ever written
            pad_shape = (n, h + 2 * self.ph, w + 2 * self.pw, c)
            xpad = self._workspace("x_pad", pad_shape, x.dtype, xp, zeroed=True)
            xpad[:, self.ph : self.ph + h, self.pw : self.pw + w, :] = x
        self.x_shape, self.x_dtype, self.chunk = x.shape, x.dtype, self.chunk_images(x)
        self.x_pad = xpad if self.chunk else None
        w2 = self.p["W"].reshape(-1, self.c_out).astype(x.dtype, copy=False)  # (kh*kw*C_in, C_out)
        y = xp.empty((n * ho * wo, self.c_out), dtype=x.dtype)
        b_row = self._tiled("b_row", self.p["b"], wo, xp) if self.has_bias else None

        def forward_chunk(first: int, count: int, slot: int, fresh: bool) -> None:
            rows = slice(first * ho * wo, (first + count) * ho * wo)
            self._gemm(xp, self._cols(xp, xpad, first, count, ho, wo, slot), w2, y[rows])
            if b_row is not None:  # broadcast along Wo*C_out-long rows, not C_out-long ones
                y2 = y[rows].reshape(count * ho, wo * self.c_out)
                y2 += b_row

        self._run_chunks(forward_chunk, n)
        return y.reshape(n, ho, wo, self.c_out)  # (N, Ho, Wo, C_out)

    def _run_chunks(self, work: Callable[[int, int, int, bool], None], n: int) -> int:
        """work(first, count, slot, fresh) for each chunk of the batch; returns the slots used.

        With compute_threads() = T > 1, slot t runs on its own thread and takes chunks t, t+T,
        ... (a fixed split, so per-slot sums repeat bitwise); fresh marks a slot's first chunk.
        """
        chunks = _chunks(n, self.chunk)
        slots = min(backend.compute_threads(), len(chunks)) if self.chunk else 1
        if slots == 1:
            for index, (first, count) in enumerate(chunks):
                work(first, count, 0, index == 0)
            return 1

        def run_slot(slot: int) -> None:
            for index in range(slot, len(chunks), slots):
                work(*chunks[index], slot, index == slot)

        run_parts(slots, run_slot)
        return slots

    def _cols(
        self, xp: Any, xpad: Any, first: int, count: int, ho: int, wo: int, slot: int = 0
    ) -> Any:
        """im2col of images [first, first+count) of xpad: (count*Ho*Wo, kh*kw*C_in), in a
        reused workspace ("cols" for the whole batch, "cols_chunk" per slot for chunks)."""
        shape = (ho, wo, self.kh, self.kw, xpad.shape[3])
        name = "cols_chunk" if self.chunk else "cols"
        cols = self._slab(name, shape, count, xpad.dtype, xp, slot)
        part = xpad[first : first + count]
        cols[...] = _windows(xp, part, ho, wo, self.kh, self.kw, self.sh, self.sw)
        return cols.reshape(count * ho * wo, -1)

    def backward(self, dy, ready=None):
        if self.seam.kernel is not None:
            dx = self.seam.kernel.backward(self, dy)
            self._done(ready)
            return dx
        xp = array_module(dy)
        n, ho, wo, f = dy.shape
        dy2 = dy.reshape(n * ho * wo, f)
        grad_w = self.g["W"].reshape(-1, f)  # (kh*kw*C_in, C_out), in the flat gradient buffer
        if self.has_bias:  # a GEMV with ones: multithreaded, unlike a sum over axis 0
            ones = self._workspace("ones", (dy2.shape[0],), dy2.dtype, xp, fill=1)
            matmul(ones, dy2, out=self.g["b"])
        if self.winograd:
            dx = conv_winograd.backward(self, dy)
            self._done(ready)
            return dx
        dx = w_in = None
        if self.input_grad:  # col2im adds into dx; the dilated form writes every element
            dx = (xp.zeros if self.col2im_input_grad else xp.empty)(self.x_shape, dtype=dy.dtype)
            w_in = self._input_grad_weight(xp)

        def backward_chunk(first: int, count: int, slot: int, fresh: bool) -> None:
            rows = slice(first * ho * wo, (first + count) * ho * wo)
            if self.chunk:  # dW summed per slot in chunk order; slot 0 sums into grad_w
                cols = self._cols(xp, self.x_pad, first, count, ho, wo, slot)
                total = self._slot_ws("dW_sum", grad_w, slot) if slot else grad_w
                part = total if fresh else self._slot_ws("dW", grad_w, slot)
                self._gemm_weight_grad(cols, dy2[rows], part, slot)
                if not fresh:
                    total += part
            else:
                matmul(self._workspace("cols").reshape(n * ho * wo, -1).T, dy2, out=grad_w)
            if dx is not None:
                images = slice(first, first + count)
                if self.col2im_input_grad:
                    self._input_grad_col2im(xp, dy[images], dx[images], w_in, slot)
                else:
                    self._input_grad(xp, dy[images], dx[images], w_in, slot)

        slots = self._run_chunks(backward_chunk, n)
        for slot in range(1, slots):  # in slot order: the same sum every step and on every rank
            grad_w += self._slot_ws("dW_sum", grad_w, slot)
        self.x_pad = None
        self._done(ready)
        return dx

    def _gemm(self, xp: Any, a: Any, b: Any, out: Any) -> None:
        """out = a @ b; on the chunked path in blocks of rows small enough for OpenBLAS's
        small-matrix kernel (SMALL_GEMM). The blocks are reshapes that split the row axis
        only: views of a and out whatever their strides."""
        block = SMALL_GEMM // (a.shape[1] * b.shape[1])
        if not self.chunk or block < MIN_BLOCK_ROWS or block >= a.shape[0]:
            matmul(a, b, out=out)
            return
        full = a.shape[0] // block * block
        # One stacked call for the full blocks: NumPy loops over them in C with the GIL
        # released, where a Python loop would hand the GIL between the chunk threads per block.
        stacked_out = out[:full].reshape(-1, block, out.shape[1])
        matmul(a[:full].reshape(-1, block, a.shape[1]), b, out=stacked_out)
        if full < a.shape[0]:
            matmul(a[full:], b, out=out[full:])

    def _gemm_weight_grad(self, cols: Any, dy: Any, out: Any, slot: int) -> None:
        """out (K, C_out) = cols.T @ dy for one chunk, cols (rows, K), dy (rows, C_out).

        Split so that each GEMM fits SMALL_GEMM where that is measured faster (the constants'
        comment): over K (blocks of out's rows, nothing to add) when the blocks stay wide;
        else over rows, the block products then summed in row order, when they stay long;
        else one GEMM. Each split is one stacked call for its full blocks (see _gemm) and one
        for the rest."""
        xp = array_module(cols)
        (rows, k), f = cols.shape, dy.shape[1]
        row_block, k_block = SMALL_GEMM // (k * f), SMALL_GEMM // (rows * f)
        if MIN_K_BLOCK_WEIGHT_GRAD <= k_block < k:
            full = k // k_block * k_block
            cols_t = cols[:, :full].reshape(rows, -1, k_block).transpose(1, 2, 0)
            matmul(cols_t, dy, out=out[:full].reshape(-1, k_block, f))
            if full < k:
                matmul(cols[:, full:].T, dy, out=out[full:])
        elif MIN_ROW_BLOCK_WEIGHT_GRAD <= row_block < rows:
            full = rows // row_block * row_block
            blocks = self._workspace(f"dW_blocks:{slot}", (full // row_block, k, f), out.dtype, xp)
            cols_t = cols[:full].reshape(-1, row_block, k).transpose(0, 2, 1)
            matmul(cols_t, dy[:full].reshape(-1, row_block, f), out=blocks)
            xp.sum(blocks, axis=0, out=out)
            if full < rows:
                rest = self._workspace(f"dW_rest:{slot}", out.shape, out.dtype, xp)
                matmul(cols[full:].T, dy[full:], out=rest)
                out += rest
        else:
            matmul(cols.T, dy, out=out)

    def _slot_ws(self, name: str, like: Any, slot: int) -> Any:
        """A workspace shaped like `like`, one per slot."""
        return self._workspace(f"{name}:{slot}", like.shape, like.dtype, array_module(like))

    def _slab(
        self,
        name: str,
        shape: tuple[int, ...],
        count: int,
        dtype: Any,
        xp: Any,
        slot: int = 0,
        **init,
    ) -> Any:
        """The first `count` images of a workspace shaped (batch or chunk, *shape), one per slot."""
        lead = self.chunk or self.x_shape[0]
        name = f"{name}:{slot}" if slot else name
        return self._workspace(name, (lead, *shape), dtype, xp, **init)[:count]

    def _input_grad_weight(self, xp: Any) -> Any:
        """The weight the input-gradient GEMM multiplies by.

        col2im: W.T, (C_out, kh*kw*C_in), copied contiguous on the chunked path: OpenBLAS's
        small-matrix kernel (SMALL_GEMM) runs at 45-80% speed on a transposed view.
        Dilated: the flipped kernel, (kh*kw*C_out, C_in), a contiguous copy by construction."""
        if self.col2im_input_grad:
            w_t = self.p["W"].reshape(-1, self.c_out).T.astype(self.x_dtype, copy=False)
            return xp.ascontiguousarray(w_t) if self.chunk else w_t
        w_flip = self.p["W"][::-1, ::-1].transpose(0, 1, 3, 2).reshape(-1, self.c_in)
        return w_flip.astype(self.x_dtype, copy=False)

    def _input_grad_col2im(self, xp: Any, dy: Any, dx: Any, w_t: Any, slot: int = 0) -> None:
        """dx (n, H, W, C_in), zeroed, += the kh*kw blocks of dy @ w_t at their input positions,
        w_t being W.T (C_out, kh*kw*C_in).

        Each kernel offset's block is clipped to the positions inside the unpadded input, so
        the padding border is never computed."""
        _, h, w, c = self.x_shape
        n, ho, wo, f = dy.shape
        dcols = self._slab("dcols_out", (ho, wo, self.kh, self.kw, c), n, dy.dtype, xp, slot)
        self._gemm(xp, dy.reshape(-1, f), w_t, dcols.reshape(n * ho * wo, -1))
        for i in range(self.kh):
            out_rows, in_rows = _clipped(i, self.ph, self.sh, ho, h)
            for j in range(self.kw):
                out_cols, in_cols = _clipped(j, self.pw, self.sw, wo, w)
                if out_rows is not None and out_cols is not None:
                    dx[:, in_rows, in_cols] += dcols[:, out_rows, out_cols, i, j]

    def _tiled(self, name: str, vec: Any, reps: int, xp: Any) -> Any:
        """vec (C,) repeated reps times, (reps*C,): a per-channel vector for a wide row view."""
        row = self._workspace(name, (reps * vec.shape[0],), vec.dtype, xp)
        row.reshape(reps, -1)[...] = vec
        return row

    def _input_grad(self, xp: Any, dy: Any, dx: Any, w_flip: Any, slot: int = 0) -> None:
        """dx (n, H, W, C_in) as a stride-1 convolution of the dilated dy with the flipped kernel
        w_flip (kh*kw*C_out, C_in).

        dy is scattered (stride apart) into a zero (n, Hp + kh - 1, Wp + kw - 1, C_out) grid,
        Hp, Wp being the padded input size; the kh x kw windows of that grid at the unpadded
        input positions are exactly the dy entries each input contributed to, so the same
        im2col + one GEMM gives dx without computing the padding border.
        """
        _, h, w, c = self.x_shape
        n, ho, wo, f = dy.shape
        kh, kw, sh, sw = self.kh, self.kw, self.sh, self.sw
        grid_shape = (h + 2 * self.ph + kh - 1, w + 2 * self.pw + kw - 1, f)
        # Zeroed once: the scatter below writes the same positions every step.
        grid = self._slab("dy_grid", grid_shape, n, dy.dtype, xp, slot, zeroed=True)
        grid[:, kh - 1 : kh + sh * (ho - 1) : sh, kw - 1 : kw + sw * (wo - 1) : sw] = dy
        dcols = self._slab("dcols", (h, w, kh, kw, f), n, dy.dtype, xp, slot)
        interior = grid[:, self.ph :, self.pw :, :]
        dcols[...] = _windows(xp, interior, h, w, kh, kw, 1, 1)
        self._gemm(xp, dcols.reshape(n * h * w, -1), w_flip, dx.reshape(n * h * w, c))

    def _workspace(self, name, shape=None, dtype=None, xp=None, zeroed=False, fill=None) -> Any:
        """A per-layer scratch array reused while its shape and dtype stay the same
        (hpcdl.nn.workspace); without a shape, the one last handed out under name."""
        if shape is None:
            return self._buffers.last(name)
        return self._buffers.get(name, shape, dtype, xp, zeroed, fill)


def _chunks(n: int, chunk: int) -> list[tuple[int, int]]:
    """(first image, image count) of each chunk of a batch of n; one whole-batch piece for 0."""
    step = chunk or n
    return [(first, min(step, n - first)) for first in range(0, n, step)]


def _clipped(k: int, pad: int, stride: int, n_out: int, n_in: int) -> tuple[Any, Any]:
    """(output slice, input slice) of kernel offset k along one axis, inside the unpadded input.

    Output position o reads input position stride*o + k - pad; the slices keep the o whose
    position lies in [0, n_in). (None, None) when none does."""
    first = max(0, -(-(pad - k) // stride))  # ceil((pad - k) / stride), at least 0
    last = min(n_out - 1, (n_in - 1 + pad - k) // stride)
    if last < first:
        return None, None
    start = stride * first + k - pad
    return slice(first, last + 1), slice(start, start + stride * (last - first) + 1, stride)


def _windows(xp: Any, x: Any, ho: int, wo: int, kh: int, kw: int, sh: int, sw: int) -> Any:
    """A read-only (N, Ho, Wo, kh, kw, C) strided view of x's sliding windows (no copy).

    Copying it into a contiguous array is the whole im2col: one copy whose inner loop runs
    over kw*C contiguous elements, instead of kh*kw copies of C-element runs.
    """
    s_n, s_h, s_w, s_c = x.strides
    return xp.lib.stride_tricks.as_strided(
        x,
        shape=(x.shape[0], ho, wo, kh, kw, x.shape[3]),
        strides=(s_n, sh * s_h, sw * s_w, s_h, s_w, s_c),
    )
