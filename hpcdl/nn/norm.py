"""BatchNorm (and SyncBatchNorm through a stat reducer) on channels-last activations.

Split from hpcdl/nn/layers.py, whose conventions it follows: parameters are views into the
model's flat buffers, backward writes gradients in place and calls `ready(self.grad_end)`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hpcdl.backend import array_module
from hpcdl.nn.dtypes import FLOAT32, matmul
from hpcdl.nn.kernels import Seam
from hpcdl.nn.layers import Layer, ParamSpec
from hpcdl.nn.threads import run_split, split_parts
from hpcdl.nn.workspace import Workspaces


class BatchNorm(Layer):
    """Batch normalisation over the last axis (channels) of (N, C) or (N, H, W, C) input.

    Training normalises with the batch statistics and updates the running ones:
    running = (1 - momentum) * running + momentum * batch (PyTorch convention; the running
    variance uses the unbiased batch variance). Evaluation uses the running statistics.

    Statistics are those of this process's batch, unless `stat_reducer` is set (SyncBatchNorm,
    `Model.set_stat_reducer`): then the per-channel sums that make the batch statistics, and
    in backward the two per-channel sums that dx needs, are summed over the ranks by calling
    `stat_reducer(buf)` on a small flat (2C+1,) or (2C,) array, so the layer normalises the
    ranks' joined batch. The forward sums are shifted by the running mean (identical on every
    rank: broadcast at start, then updated from global statistics) so that E[x^2] - E[x]^2 does
    not cancel in float32. The parameter gradients stay local: the gradient allreduce sums them.

    Passes over the activations (why it is written this way): per-channel sums are GEMVs with
    ones; elementwise work runs on (N*H, W*C) rows against per-channel vectors tiled W times,
    because a C-long inner loop (C = 16 in resnet20) costs NumPy 2-3x more per element. Forward
    keeps only xc = x - mean (a reused per-layer array), not xhat: y = xc * (gamma * inv_std)
    + beta is one scale and one shift, and backward folds inv_std into per-channel factors:
    dx = (dy - sum(dy)/M) * gamma * inv_std - xc * gamma * inv_std^3 * sum(dy * xc)/M.

    Real half arrays (hpcdl.nn.dtypes) without a fast kernel (SyncBatchNorm, CPU tests): the
    reference runs on a float32 copy of x and of dy, the format's arrays in and out.

    Threads (hpcdl.nn.threads): every pass is split by rows over the compute threads; the
    per-channel sums are made per part and added in part order, so a thread count repeats
    bitwise. Forward makes three split passes (sums; centring + squared sums; scale + shift),
    backward two (the two gradient sums; dx).
    """

    fresh_output = True

    def __init__(self, channels: int, momentum: float = 0.1, eps: float = 1e-5) -> None:
        super().__init__()
        self.channels, self.momentum, self.eps = channels, momentum, eps
        self.stat_reducer: Callable[[Any], None] | None = None  # sums a flat array over ranks
        self.count: Any = None  # rows in the (joined) batch, as a 1-element array
        self.param_specs = (
            ParamSpec("beta", (channels,), "zeros", decay=False),
            ParamSpec("gamma", (channels,), "ones", decay=False),
        )
        self.buffer_specs = (("running_mean", (channels,), 0.0), ("running_var", (channels,), 1.0))
        self.xc: Any = None  # x - mean from forward, same shape as x; backward consumes it
        self.inv_std: Any = None  # (C,) 1 / sqrt(var + eps) from forward
        self.train = True
        # xc's storage, reused while the input shape stays the same; (M,) ones for the GEMV sums
        self._work = Workspaces()
        self.seam = Seam("batchnorm")  # fast kernels come first (hpcdl.nn.kernels)
        # A fused BN -> [add ->] ReLU asked for by a container (forward_relu), for this forward
        self.fuse_relu = False
        self.residual: Any = None  # the add's other operand, the shortcut's output
        self.residual_grad: Any = None  # after a fused backward with a residual: its gradient

    def forward(self, x, train=True):
        if x.shape[-1] != self.channels:
            raise ValueError(f"BatchNorm expects {self.channels} channels, got shape {x.shape}")
        if self.seam.take(self, x):
            return self.seam.kernel.forward(self, x, train)
        if x.dtype.itemsize == 2:  # real half arrays (hpcdl.nn.dtypes): statistics in float32
            return self._reference_forward(x.astype(FLOAT32), train).astype(x.dtype)
        return self._reference_forward(x, train)

    def _reference_forward(self, x: Any, train: bool) -> Any:
        xp = array_module(x)
        reps = _row_reps(x)
        xc = self._centered_buffer(xp, x)
        y = xp.empty_like(x)
        if train:
            mean, var = self._batch_stats(xp, x, xc, y)  # leaves x - mean in xc
        else:
            mean = self.b["running_mean"].astype(x.dtype)
            var = self.b["running_var"].astype(x.dtype)
        inv_std = 1.0 / xp.sqrt(var + self.eps)
        x_rows, xc_rows, y_rows = _rows(x, reps), _rows(xc, reps), _rows(y, reps)
        mean_row = None if train else xp.tile(mean, reps)
        scale_row = xp.tile(self.p["gamma"] * inv_std, reps)
        beta_row = xp.tile(self.p["beta"], reps)

        def normalise(first: int, count: int, part: int) -> None:
            rows = slice(first, first + count)
            if mean_row is not None:
                xp.subtract(x_rows[rows], mean_row, out=xc_rows[rows])
            xp.multiply(xc_rows[rows], scale_row, out=y_rows[rows])
            y_rows[rows] += beta_row

        run_split(len(y_rows), normalise, y)
        self.xc, self.inv_std, self.train = xc, inv_std, train
        return y

    def forward_relu(self, x: Any, train: bool, residual: Any = None) -> Any:
        """relu(self(x) [+ residual]) by a fused kernel (hpcdl.nn.kernels.batchnorm), or None
        when none takes it: then the caller runs forward and the ReLU itself. Training only;
        backward then takes the ReLU's output gradient and leaves residual's in residual_grad.
        """
        if not train or x.shape[-1] != self.channels:
            return None
        self.fuse_relu, self.residual, self.residual_grad = True, residual, None
        fused = self.seam.take(self, x) and getattr(self.seam.kernel, "fuses_relu", False)
        z = self.seam.kernel.forward(self, x, train) if fused else None
        self.fuse_relu, self.residual = False, residual if fused else None
        if not fused:
            self.seam.kernel = None
        return z

    def backward(self, dy, ready=None):
        if self.seam.kernel is not None:
            dx = self.seam.kernel.backward(self, dy)
            self._done(ready)
            return dx
        if dy.dtype.itemsize == 2:  # as forward: the reference in float32, dx in the format
            dx = self._reference_backward(dy.astype(FLOAT32), ready)
            return None if dx is None else dx.astype(dy.dtype)
        return self._reference_backward(dy, ready)

    def _reference_backward(self, dy: Any, ready: Any) -> Any:
        xp = array_module(dy)
        reps, c = _row_reps(dy), self.channels
        xc, inv_std = self.xc, self.inv_std
        dx = xp.empty_like(dy)
        dx_rows, dy_rows, xc_rows = _rows(dx, reps), _rows(dy, reps), _rows(xc, reps)

        def sums(rows: slice, ones: Any, out: Any) -> None:  # out: [sum(dy), sum(dy * xc)]
            matmul(ones, _channels(dy_rows[rows], c), out=out[:c])
            xp.multiply(dy_rows[rows], xc_rows[rows], out=dx_rows[rows])  # scratch: dy * xc
            matmul(ones, _channels(dx_rows[rows], c), out=out[c:])

        total = self._split_sums(dy, 2 * c, sums)
        self.g["beta"][...] = total[:c]
        xp.multiply(total[c:], inv_std, out=self.g["gamma"])  # sum(dy * xhat)
        if self.input_grad:
            self._input_grad(xp, dy, dx, reps)
        else:
            dx = None
        self._done(ready)
        self.xc = None
        return dx

    def _input_grad(self, xp: Any, dy: Any, dx: Any, reps: int) -> None:
        """dx from dy and the gradient sums just written to g["beta"], g["gamma"]."""
        c, inv_std = self.channels, self.inv_std
        dx_rows, dy_rows, xc_rows = _rows(dx, reps), _rows(dy, reps), _rows(self.xc, reps)
        scale = self.p["gamma"] * inv_std
        scale_row, xc_row, shift_row = xp.tile(scale, reps), None, None
        if self.train:
            sum_dy, sum_dy_xhat, m = self.g["beta"], self.g["gamma"], dy.size // c
            if self.stat_reducer is not None:  # the sums over the joined batch
                sums = xp.concatenate([sum_dy, sum_dy_xhat])  # (2C,)
                self.stat_reducer(sums)
                sum_dy, sum_dy_xhat, m = sums[:c], sums[c:], self.count
            xc_row = xp.tile(-scale * inv_std * (sum_dy_xhat / m), reps)
            shift_row = xp.tile(-scale * (sum_dy / m), reps)

        def input_grad(first: int, count: int, part: int) -> None:
            rows = slice(first, first + count)
            xp.multiply(dy_rows[rows], scale_row, out=dx_rows[rows])
            if xc_row is not None:
                xc_rows[rows] *= xc_row
                dx_rows[rows] += xc_rows[rows]
                dx_rows[rows] += shift_row

        run_split(len(dx_rows), input_grad, dx)

    def _batch_stats(self, xp: Any, x: Any, xc: Any, scratch: Any) -> tuple[Any, Any]:
        """(mean (C,), biased var (C,)) of the batch; updates the running statistics.

        Writes x - mean into xc; scratch (x's shape) is overwritten."""
        c, reps = self.channels, _row_reps(x)
        x_rows, xc_rows, sq_rows = _rows(x, reps), _rows(xc, reps), _rows(scratch, reps)
        if self.stat_reducer is None:
            m = x.size // c

            def sum_x(rows: slice, ones: Any, out: Any) -> None:
                matmul(ones, _channels(x_rows[rows], c), out=out)

            mean = self._split_sums(x, c, sum_x)
            mean /= m
            mean_row = xp.tile(mean, reps)

            def sum_sq(rows: slice, ones: Any, out: Any) -> None:
                xp.subtract(x_rows[rows], mean_row, out=xc_rows[rows])
                xp.multiply(xc_rows[rows], xc_rows[rows], out=sq_rows[rows])
                matmul(ones, _channels(sq_rows[rows], c), out=out)

            var = self._split_sums(x, c, sum_sq)
            var /= m
            factor = self.momentum * m / max(m - 1, 1)  # unbiased variance into running
        else:
            mean, var, m = self._global_stats(xp, x, xc, scratch)
            factor = self.momentum * m / xp.maximum(m - 1, 1)
        rm, rv = self.b["running_mean"], self.b["running_var"]
        rm *= 1.0 - self.momentum
        rm += self.momentum * mean.astype(rm.dtype)
        rv *= 1.0 - self.momentum
        rv += factor * var.astype(rv.dtype)
        return mean, var

    def _global_stats(self, xp: Any, x: Any, xc: Any, scratch: Any) -> tuple[Any, Any, Any]:
        """(mean (C,), biased var (C,), count (1,)) of the ranks' joined batch; x - mean in xc.

        One reduction of [sum(x - K), sum((x - K)^2), M] with K the running mean."""
        c, reps = self.channels, _row_reps(x)
        x_rows, xc_rows, sq_rows = _rows(x, reps), _rows(xc, reps), _rows(scratch, reps)
        shift = self.b["running_mean"].astype(x.dtype)
        shift_row = xp.tile(shift, reps)

        def shifted_sums(rows: slice, ones: Any, out: Any) -> None:  # [sum(x - K), sum((x-K)^2)]
            xp.subtract(x_rows[rows], shift_row, out=xc_rows[rows])
            xp.multiply(xc_rows[rows], xc_rows[rows], out=sq_rows[rows])
            matmul(ones, _channels(xc_rows[rows], c), out=out[:c])
            matmul(ones, _channels(sq_rows[rows], c), out=out[c:])

        stats = xp.empty(2 * c + 1, dtype=x.dtype)
        stats[: 2 * c] = self._split_sums(x, 2 * c, shifted_sums)
        stats[2 * c] = x.size // c
        self.stat_reducer(stats)
        count = self.count = stats[2 * c :]
        shifted_mean = stats[:c] / count
        var = stats[c : 2 * c] / count
        var -= shifted_mean * shifted_mean
        xp.maximum(var, 0, out=var)  # rounding must not make it negative
        mean_row = xp.tile(shifted_mean, reps)

        def recentre(first: int, count: int, part: int) -> None:  # (x - K) - (mean - K)
            xc_rows[first : first + count] -= mean_row

        run_split(len(xc_rows), recentre, xc)
        return shifted_mean + shift, var, count

    def _split_sums(self, x: Any, width: int, sums: Callable[[slice, Any, Any], None]) -> Any:
        """(width,) per-channel sums over x's rows, split over the compute threads.

        sums(rows, ones, out) writes the sums of a slice of `_rows(x)` rows into out (width,),
        ones being a ones vector as long as that slice's channel vectors. The parts' sums are
        added in part order (hpcdl.nn.threads: deterministic)."""
        xp, reps = array_module(x), _row_reps(x)
        n_rows = x.size // (reps * x.shape[-1])
        ones = self._ones(xp, n_rows * reps, x.dtype)
        partial = xp.empty((split_parts(n_rows, x), width), dtype=x.dtype)

        def part_sums(first: int, count: int, part: int) -> None:
            sums(slice(first, first + count), ones[: count * reps], partial[part])

        parts = run_split(n_rows, part_sums, x)
        total = partial[0]
        for part in range(1, parts):
            total += partial[part]
        return total

    def _centered_buffer(self, xp: Any, x: Any) -> Any:
        """The per-layer array that holds x - mean, reallocated only when x's shape changes."""
        return self._work.get("xc", x.shape, x.dtype, xp)

    def _ones(self, xp: Any, m: int, dtype: Any) -> Any:
        """A cached (M,) vector of ones: per-channel sums over M rows as one GEMV.

        A reduction over axis 0 of (M, C) with few channels is slow in CuPy (~1 ms per call
        at M = 131k, C = 16 on an H100: BatchNorm was 95% of a resnet20 step) and
        single-threaded in NumPy; the BLAS matrix-vector product is neither."""
        return self._work.get("ones", (m,), dtype, xp, fill=1)


def _row_reps(x: Any) -> int:
    """How many channel vectors one row of `_rows(x)` holds: W for (N, H, W, C), else 1."""
    return x.shape[-2] if x.ndim >= 3 else 1


def _rows(x: Any, reps: int) -> Any:
    """Contiguous x (..., C) as (rows, reps*C), for elementwise work against tiled vectors."""
    return x.reshape(-1, reps * x.shape[-1])


def _channels(rows: Any, c: int) -> Any:
    """A `_rows` block (rows, reps*C) as (rows*reps, C): one channel vector per row."""
    return rows.reshape(-1, c)
