"""Leaf layers with forward and backward; one code path for NumPy and CuPy.

Every layer takes the array module of its input (`array_module(x)`). Image activations inside a
model are channels-last, (N, H, W, C): that makes the convolution's big GEMM contiguous and lets
per-channel statistics reduce over a contiguous (N*H*W, C) matrix. `Model.forward` converts its
(N, C, H, W) input once.

Parameters are not owned by layers: a layer declares `param_specs` (name, shape, init) and the
model binds views into its flat buffers (`bind`). Backward writes gradients in place into those
views and then calls `ready(self.grad_end)` so the model can report that the buffer's prefix is
final.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from hpcdl.backend import array_module
from hpcdl.nn.dtypes import matmul, sum_dtype
from hpcdl.nn.init import check_initialiser
from hpcdl.nn.kernels import Seam
from hpcdl.nn.kernels.dropout import feeding as dropout_keys_fed
from hpcdl.nn.threads import run_split, split_multiply

Ready = Callable[[int], None] | None


@dataclass(frozen=True)
class ParamSpec:
    """A parameter a layer needs: its name, shape and initialiser (a name in hpcdl.nn.init).

    fan_in/fan_out are what the initialiser scales by (e.g. kh*kw*C_in for a convolution).
    decay: False for biases and BatchNorm parameters (`Model.decay_mask`).
    """

    name: str
    shape: tuple[int, ...]
    init: str
    fan_in: int = 1
    fan_out: int = 1
    decay: bool = True

    def __post_init__(self) -> None:
        check_initialiser(self.init)  # fail when the layer is built, not when it is bound


class Layer:
    """Base class: parameter-free, identity-free; subclasses override forward/backward."""

    param_specs: tuple[ParamSpec, ...] = ()
    buffer_specs: tuple[tuple[str, tuple[int, ...], float], ...] = ()
    # Set by the model on its first parameterised layer: the input needs no gradient.
    input_grad = True
    # True when forward returns a new array that the layer keeps no reference to, so the next
    # layer may overwrite it (Sequential lets a ReLU after such a layer work in place).
    fresh_output = False
    # True when output and input gradient hold only values of the input and output gradient
    # (ReLU, Flatten): reduced precision (hpcdl.nn.precision) needs no rounding after it.
    keeps_precision = False
    # The --precision whose values the layer computes on (Model.set_precision): a fast kernel
    # may then run on arrays of that format (hpcdl.nn.dtypes).
    precision = "fp32"

    def __init__(self) -> None:
        self.p: dict[str, Any] = {}  # name -> view into model.params
        self.g: dict[str, Any] = {}  # name -> view into model.grads
        self.b: dict[str, Any] = {}  # name -> view into model.buffers
        self.grad_end = 0  # offset in model.grads after this layer's gradients

    def bind(self, params: dict, grads: dict, buffers: dict, grad_end: int) -> None:
        self.p, self.g, self.b, self.grad_end = params, grads, buffers, grad_end

    def leaves(self) -> Iterator[Layer]:
        """Leaf layers in the order backward finishes them (the flat layout's order)."""
        yield self

    def named_children(self) -> list[tuple[str, Layer]]:
        """Sub-layers that own parameters or buffers, by name (empty for a leaf)."""
        return []

    def forward(self, x: Any, train: bool = True) -> Any:
        raise NotImplementedError

    def backward(self, dy: Any, ready: Ready = None) -> Any:
        raise NotImplementedError

    def _done(self, ready: Ready) -> None:
        if ready is not None and self.param_specs:
            ready(self.grad_end)


class Linear(Layer):
    """y = x @ W + b; x (N, in), W (in, out), b (out,).

    Initialisers (hpcdl.nn.init) default to PyTorch's nn.Linear: U(+-1/sqrt(n_in)) for both.
    """

    fresh_output = True

    def __init__(
        self, n_in: int, n_out: int, init: str = "torch_default", bias_init: str = "torch_default"
    ) -> None:
        super().__init__()
        self.n_in, self.n_out = n_in, n_out
        self.param_specs = (
            ParamSpec("b", (n_out,), bias_init, n_in, n_out, decay=False),
            ParamSpec("W", (n_in, n_out), init, n_in, n_out),
        )

    def forward(self, x, train=True):
        xp = array_module(x)
        self.x = x
        w = self.p["W"].astype(x.dtype, copy=False)  # real half arrays: the format's weights
        y = xp.empty((x.shape[0], self.n_out), dtype=xp.result_type(x, w))  # (N, out)

        def rows(first: int, count: int, part: int) -> None:
            matmul(x[first : first + count], w, out=y[first : first + count])
            y[first : first + count] += self.p["b"]

        run_split(len(x), rows, w)  # the GEMM's cost scales with W's size
        return y

    def backward(self, dy, ready=None):
        xp = array_module(dy)
        x, w, grad_w = self.x, self.p["W"].astype(dy.dtype, copy=False), self.g["W"]

        def grad_rows(first: int, count: int, part: int) -> None:  # dW rows = x columns
            inputs = slice(first, first + count)
            matmul(x[:, inputs].T, dy, out=grad_w[inputs])

        run_split(self.n_in, grad_rows, w)
        dy.sum(axis=0, out=self.g["b"], dtype=sum_dtype(dy))
        dx = None
        if self.input_grad:
            dx = xp.empty(x.shape, dtype=xp.result_type(dy, w))  # (N, in)

            def input_rows(first: int, count: int, part: int) -> None:
                matmul(dy[first : first + count], w.T, out=dx[first : first + count])

            run_split(len(dy), input_rows, w)
        self._done(ready)
        self.x = None
        return dx


class ReLU(Layer):
    """max(x, 0). inplace: overwrite x (set by containers when x is a fresh, unshared output;
    this fuses e.g. a convolution's bias add and the ReLU into the same buffer, saving an
    allocation and its page faults)."""

    keeps_precision = True

    def __init__(self, inplace: bool = False) -> None:
        super().__init__()
        self.inplace = inplace
        self.mask: Any = None  # (x's shape) bool: where the input was > 0

    def forward(self, x, train=True, residual: Any = None):
        """max(x, 0); with `residual`, max(x + residual, 0) written into x (an inplace ReLU
        only): a residual add and its ReLU in one pass over the batch."""
        xp = array_module(x)
        if residual is not None and not self.inplace:
            raise ValueError("ReLU adds a residual into its input: the ReLU must be inplace")
        y = x if self.inplace else xp.empty_like(x)
        mask = self.mask = xp.empty(x.shape, dtype=bool)

        def relu(first: int, count: int, part: int) -> None:
            images = slice(first, first + count)
            if residual is not None:
                x[images] += residual[images]
            xp.maximum(x[images], 0, out=y[images])
            xp.greater(y[images], 0, out=mask[images])

        run_split(len(x), relu, x)
        return y

    def backward(self, dy, ready=None):
        return split_multiply(dy, self.mask)


class Flatten(Layer):
    """(N, ...) -> (N, prod(...))."""

    keeps_precision = True

    def forward(self, x, train=True):
        self.shape = x.shape
        return x.reshape(x.shape[0], -1)

    def backward(self, dy, ready=None):
        return dy.reshape(self.shape)


class Dropout(Layer):
    """Inverted dropout: zero each element with probability p in training, identity in eval.

    The mask comes from `xp.random.default_rng(seed)` with a seed drawn from `self.rng`, a host
    NumPy Generator that the model shares between its dropout layers (so its state is JSON-able).
    """

    def __init__(self, p: float, rng: np.random.Generator | None = None) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"Dropout probability must be in [0, 1), got {p}")
        self.rate = p
        self.rng = rng if rng is not None else np.random.default_rng(0)
        self.mask = None
        self.seam = Seam("dropout")  # fast kernels come first (hpcdl.nn.kernels)

    def forward(self, x, train=True):
        if not train or self.rate == 0.0:
            self.mask = None
            return x
        if self.seam.take(self, x):
            return self.seam.kernel.forward(self, x, train)
        if dropout_keys_fed():  # NOTE [dropout keys in a graph]: its seed would repeat
            raise RuntimeError("a dropout the Philox kernel does not take cannot be captured")
        xp = array_module(x)
        seed = int(self.rng.integers(2**63))
        u = xp.random.default_rng(seed).random(x.shape, dtype=xp.float32)
        keep = x.dtype.type(1.0 / (1.0 - self.rate))  # a scalar: CuPy rejects NumPy 0-d arrays
        mask = self.mask = xp.empty(x.shape, dtype=x.dtype)
        y = xp.empty_like(mask)

        def drop(first: int, count: int, part: int) -> None:
            images = slice(first, first + count)
            xp.multiply(u[images] >= self.rate, keep, out=mask[images])
            xp.multiply(x[images], mask[images], out=y[images])

        run_split(len(x), drop, x)
        return y

    def backward(self, dy, ready=None):
        if self.seam.kernel is not None:
            return self.seam.kernel.backward(self, dy)
        return dy if self.mask is None else split_multiply(dy, self.mask)


class MaxPool2d(Layer):
    """Max over (kh, kw) windows with the given stride on (N, H, W, C); floor output size.

    padding: implicit -inf borders (PyTorch's nn.MaxPool2d), so a window's maximum is always
    one of its input values; ResNet's stem pools 3x3, stride 2, padding 1.
    Tied maxima share the gradient equally (the sum of dx equals the sum of dy). Both passes
    loop over the kh*kw window offsets, each a strided (N, Ho, Wo, C) view, with `out=` ufuncs:
    for cnn's 2x2 pools at batch 64 that is 4x faster forward and 2x faster backward than
    reducing a (N, Ho, kh, Wo, kw, C) reshape over two non-contiguous axes. Non-overlapping
    windows (stride == kernel, the usual case) write each offset's share of dx; overlapping
    ones add it.
    """

    def __init__(
        self,
        kernel: int | tuple[int, int] = 2,
        stride: int | tuple | None = None,
        padding: int | tuple[int, int] = 0,
    ):
        super().__init__()
        self.kh, self.kw = _pair(kernel)
        self.sh, self.sw = _pair(stride) if stride is not None else (self.kh, self.kw)
        self.ph, self.pw = _pair(padding)
        if 2 * self.ph > self.kh or 2 * self.pw > self.kw:
            raise ValueError(
                f"MaxPool2d padding {self.ph},{self.pw} must be at most half the kernel "
                f"{self.kh}x{self.kw}"
            )
        self.tiled = (self.sh, self.sw) == (self.kh, self.kw)
        self.seam = Seam("pool")  # fast kernels come first (hpcdl.nn.kernels)

    def _out_hw(self, x_shape) -> tuple[int, int]:
        _, h, w, _ = x_shape
        return (h - self.kh) // self.sh + 1, (w - self.kw) // self.sw + 1

    def _padded(self, xp, x):
        """x with -inf borders (N, H + 2ph, W + 2pw, C); x itself without padding."""
        if not (self.ph or self.pw):
            return x
        n, h, w, c = x.shape
        out = xp.full((n, h + 2 * self.ph, w + 2 * self.pw, c), -xp.inf, dtype=x.dtype)
        out[:, self.ph : self.ph + h, self.pw : self.pw + w] = x
        return out

    def _offsets(self, ho: int, wo: int):
        for i in range(self.kh):
            for j in range(self.kw):
                rows = slice(i, i + self.sh * (ho - 1) + 1, self.sh)
                cols = slice(j, j + self.sw * (wo - 1) + 1, self.sw)
                yield (slice(None), rows, cols)

    def forward(self, x, train=True):
        if self.seam.take(self, x):
            return self.seam.kernel.forward(self, x, train)
        xp = array_module(x)
        self.x_shape = x.shape
        x = self._padded(xp, x)
        ho, wo = self._out_hw(x.shape)
        if ho < 1 or wo < 1:
            raise ValueError(f"MaxPool2d {self.kh}x{self.kw} does not fit input shape {x.shape}")
        y = xp.empty((x.shape[0], ho, wo, x.shape[3]), dtype=x.dtype)
        first_window, *windows = self._offsets(ho, wo)

        def pool(first: int, count: int, part: int) -> None:
            images, out = x[first : first + count], y[first : first + count]
            out[...] = images[first_window]
            for window in windows:
                xp.maximum(out, images[window], out=out)

        run_split(len(x), pool, x)
        self.x, self.y = x, y  # (N, H, W, C), (N, Ho, Wo, C)
        return y

    def backward(self, dy, ready=None):
        if self.seam.kernel is not None:
            return self.seam.kernel.backward(self, dy)
        xp = array_module(dy)
        x, y = self.x, self.y
        ho, wo = y.shape[1:3]
        covered = self.tiled and (ho * self.kh, wo * self.kw) == x.shape[1:3]
        dx = xp.empty(x.shape, dtype=dy.dtype) if covered else xp.zeros(x.shape, dtype=dy.dtype)
        windows = list(self._offsets(ho, wo))

        def pool_grad(first: int, count: int, part: int) -> None:
            images = slice(first, first + count)
            x_part, dx_part = x[images], dx[images]
            hits = [x_part[win] == y[images] for win in windows]  # (count, Ho, Wo, C) bool each
            ties = hits[0].astype(dy.dtype)
            for hit in hits[1:]:
                ties += hit
            share = dy[images] / ties
            for win, hit in zip(windows, hits):
                if self.tiled:  # the windows do not overlap: each input gets one share at most
                    xp.multiply(hit, share, out=dx_part[win])
                else:
                    dx_part[win] += hit * share

        run_split(len(x), pool_grad, x)
        self.x = self.y = None
        if self.ph or self.pw:  # the -inf border never holds a maximum: drop it
            _, h, w, _ = self.x_shape
            dx = dx[:, self.ph : self.ph + h, self.pw : self.pw + w]
        return dx


class GlobalAvgPool(Layer):
    """(N, H, W, C) -> (N, C): mean over the spatial positions."""

    def forward(self, x, train=True):
        self.x_shape = x.shape  # half arrays: summed in float32, the mean in the format
        return x.mean(axis=(1, 2), dtype=sum_dtype(x)).astype(x.dtype, copy=False)

    def backward(self, dy, ready=None):
        xp = array_module(dy)
        n, h, w, c = self.x_shape
        scale = dy.dtype.type(1.0 / (h * w))
        return xp.broadcast_to((dy * scale)[:, None, None, :], self.x_shape).copy()


def _pair(v: int | tuple[int, int]) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else (int(v[0]), int(v[1]))
