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
"""

from __future__ import annotations

from typing import Any

from hpcdl.backend import array_module
from hpcdl.nn.layers import Layer, ParamSpec, _pair


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
        self._buffers: dict[str, Any] = {}  # reused workspaces (im2col matrices)

    def output_hw(self, h: int, w: int) -> tuple[int, int]:
        ho = (h + 2 * self.ph - self.kh) // self.sh + 1
        wo = (w + 2 * self.pw - self.kw) // self.sw + 1
        return ho, wo

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
        xpad = x
        if self.ph or self.pw:  # the border stays zero: only the interior is ever written
            pad_shape = (n, h + 2 * self.ph, w + 2 * self.pw, c)
            xpad = self._workspace("x_pad", pad_shape, x.dtype, xp, zeroed=True)
            xpad[:, self.ph : self.ph + h, self.pw : self.pw + w, :] = x
        cols = self._workspace("cols", (n, ho, wo, self.kh, self.kw, c), x.dtype, xp)
        cols[...] = _windows(xp, xpad, ho, wo, self.kh, self.kw, self.sh, self.sw)
        self.x_shape = x.shape
        y = cols.reshape(n * ho * wo, -1) @ self.p["W"].reshape(-1, self.c_out)
        if self.has_bias:  # broadcast along Wo*C_out-long rows: a C_out-long inner loop is slow
            y2 = y.reshape(n * ho, wo * self.c_out)
            y2 += self._tiled("b_row", self.p["b"], wo, xp)
        return y.reshape(n, ho, wo, self.c_out)  # (N, Ho, Wo, C_out)

    def backward(self, dy, ready=None):
        xp = array_module(dy)
        n, ho, wo, f = dy.shape
        dy2 = dy.reshape(n * ho * wo, f)
        cols2 = self._workspace("cols").reshape(n * ho * wo, -1)
        xp.matmul(cols2.T, dy2, out=self.g["W"].reshape(-1, f))
        if self.has_bias:  # a GEMV with ones: multithreaded, unlike a sum over axis 0
            ones = self._workspace("ones", (dy2.shape[0],), dy2.dtype, xp, fill=1)
            xp.matmul(ones, dy2, out=self.g["b"])
        dx = None
        if self.input_grad:
            col2im = self.col2im_input_grad
            dx = self._input_grad_col2im(xp, dy) if col2im else self._input_grad(xp, dy)
        self._done(ready)
        return dx

    def _input_grad_col2im(self, xp: Any, dy: Any) -> Any:
        """dx (N, H, W, C_in) = the kh*kw blocks of dy @ W.T added at their input positions.

        Each kernel offset's block is clipped to the positions inside the unpadded input, so
        the padding border is never computed."""
        n, h, w, c = self.x_shape
        _, ho, wo, f = dy.shape
        dcols = self._workspace("dcols_out", (n, ho, wo, self.kh, self.kw, c), dy.dtype, xp)
        w2 = self.p["W"].reshape(-1, f)  # (kh*kw*C_in, C_out)
        xp.matmul(dy.reshape(-1, f), w2.T, out=dcols.reshape(n * ho * wo, -1))
        dx = xp.zeros(self.x_shape, dtype=dy.dtype)
        for i in range(self.kh):
            out_rows, in_rows = _clipped(i, self.ph, self.sh, ho, h)
            for j in range(self.kw):
                out_cols, in_cols = _clipped(j, self.pw, self.sw, wo, w)
                if out_rows is not None and out_cols is not None:
                    dx[:, in_rows, in_cols] += dcols[:, out_rows, out_cols, i, j]
        return dx

    def _tiled(self, name: str, vec: Any, reps: int, xp: Any) -> Any:
        """vec (C,) repeated reps times, (reps*C,): a per-channel vector for a wide row view."""
        row = self._workspace(name, (reps * vec.shape[0],), vec.dtype, xp)
        row.reshape(reps, -1)[...] = vec
        return row

    def _input_grad(self, xp: Any, dy: Any) -> Any:
        """dx as a stride-1 convolution of the dilated dy with the flipped kernel.

        dy is scattered (stride apart) into a zero (N, Hp + kh - 1, Wp + kw - 1, C_out) grid,
        Hp, Wp being the padded input size; the kh x kw windows of that grid at the unpadded
        input positions are exactly the dy entries each input contributed to, so the same
        im2col + one GEMM gives dx (N, H, W, C_in) without computing the padding border.
        """
        n, h, w, c = self.x_shape
        _, ho, wo, f = dy.shape
        kh, kw, sh, sw = self.kh, self.kw, self.sh, self.sw
        grid_shape = (n, h + 2 * self.ph + kh - 1, w + 2 * self.pw + kw - 1, f)
        # Zeroed once: the scatter below writes the same positions every step.
        grid = self._workspace("dy_grid", grid_shape, dy.dtype, xp, zeroed=True)
        grid[:, kh - 1 : kh + sh * (ho - 1) : sh, kw - 1 : kw + sw * (wo - 1) : sw] = dy
        dcols = self._workspace("dcols", (n, h, w, kh, kw, f), dy.dtype, xp)
        interior = grid[:, self.ph :, self.pw :, :]
        dcols[...] = _windows(xp, interior, h, w, kh, kw, 1, 1)
        w_flip = self.p["W"][::-1, ::-1].transpose(0, 1, 3, 2).reshape(-1, c)  # (kh*kw*F, C)
        return (dcols.reshape(n * h * w, -1) @ w_flip).reshape(n, h, w, c)

    def _workspace(self, name, shape=None, dtype=None, xp=None, zeroed=False, fill=None) -> Any:
        """A per-layer scratch array reused while its shape and dtype stay the same.

        Large arrays freed every step would be unmapped and page-faulted back in each time.
        zeroed/fill initialise it when (re)allocated only; callers rely on that.
        """
        buf = self._buffers.get(name)
        if shape is None:
            return buf
        if buf is None or buf.shape != shape or buf.dtype != dtype or array_module(buf) is not xp:
            buf = xp.zeros(shape, dtype=dtype) if zeroed else xp.empty(shape, dtype=dtype)
            if fill is not None:
                buf.fill(fill)
            self._buffers[name] = buf
        return buf


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
