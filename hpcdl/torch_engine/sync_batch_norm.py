"""SyncBatchNorm: batch normalisation over the whole global batch (every rank's samples).

The batch statistics are sums over all ranks, taken with a differentiable sum
(SyncBatchNorm._sum_over_ranks): the per-channel sum and count, then the sum of squared
deviations from the global mean (two passes: no cancellation in E[x^2] - E[x]^2). The gradient
then needs no code of its own: the sum's backward sums the gradients that flow into the
statistics over the ranks, which is exactly the global batch's gradient. So every rank must run
forward and backward, in the same order. Evaluation uses the running statistics, updated in
training from the global mean and the unbiased global variance, as torch's BatchNorm does.

Two flavours share the math: this one sums over hpcdl.train's World through a
hpcdl.comm.collectives.SumReducer (its own duplicate communicator, beside the
GradientReducer's thread), and hpcdl.torch's hvd.SyncBatchNorm sums with hvd's allreduce.
convert() swaps a module's BatchNorm layers for this one (hpcdl.train --sync-bn).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["SyncBatchNorm", "convert"]


class SyncBatchNorm(_BatchNorm):
    """BatchNorm over every rank's batch (N-dimensional; input (N, C, ...)). reducer: the
    SumReducer the ranks sum over; None: one rank, plain batch norm."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        reducer: Any = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.reducer = reducer  # a plain attribute: not a parameter, buffer or state-dict key

    def _ranks(self) -> int:
        """How many ranks share the batch."""
        return 1 if self.reducer is None else self.reducer.comm.Get_size()

    def _sum_over_ranks(self, t: Any) -> Any:
        """t summed over the ranks, differentiable: the backward sums the gradient too."""
        return _RankSum.apply(t, self.reducer)

    def _check_input_dim(self, input: Any) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: Any) -> Any:
        self._check_input_dim(input)
        if self.training and self.track_running_stats:  # in place: FlatModule holds the tensor
            self.num_batches_tracked.add_(1)
        batch_stats = self.training or not self.track_running_stats  # else the running ones
        if not batch_stats or self._ranks() == 1:
            return F.batch_norm(
                input,
                self.running_mean,
                self.running_var,
                self.weight,
                self.bias,
                batch_stats,
                self._factor() if batch_stats else 0.0,
                self.eps,
            )
        return self._global_batch(input)

    def _factor(self) -> float:
        if self.momentum is None:  # a cumulative moving average
            return 1.0 / float(self.num_batches_tracked)
        return self.momentum

    def _global_batch(self, x: Any) -> Any:
        if x.dtype in (torch.float16, torch.bfloat16):  # autocast: statistics in float32
            x = x.float()
        dims = [0, *range(2, x.dim())]
        shape = [1, x.shape[1]] + [1] * (x.dim() - 2)
        count = torch.tensor([x.numel() // x.shape[1]], dtype=x.dtype, device=x.device)
        totals = self._sum_over_ranks(torch.cat([x.sum(dims), count]))
        n = totals[-1]
        mean = totals[:-1] / n
        centered = x - mean.view(shape)
        var = self._sum_over_ranks((centered * centered).sum(dims)) / n
        out = centered * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        if self.track_running_stats:
            with torch.no_grad():
                m = self._factor()
                unbiased = var * n / max(float(n) - 1.0, 1.0)
                self.running_mean.mul_(1 - m).add_(mean.detach(), alpha=m)
                self.running_var.mul_(1 - m).add_(unbiased.detach(), alpha=m)
        return out


class _RankSum(torch.autograd.Function):
    """The sum of a small tensor over the ranks; its gradient is the incoming gradient summed
    over the ranks (each rank's loss depends on every rank's input through the statistics)."""

    @staticmethod
    def forward(ctx: Any, t: Any, reducer: Any) -> Any:
        ctx.reducer = reducer
        return _summed(t, reducer)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, None]:
        # CPU: in the thread that called backward(); CUDA: in autograd's device thread while
        # that one waits. Either way one thread at a time on the reducer's communicator.
        return _summed(grad, ctx.reducer), None


def _summed(t: Any, reducer: Any) -> Any:
    """A new tensor: t summed over reducer's ranks. A CUDA tensor goes through host memory: a
    few KB per BatchNorm layer (C + 1 values), and .cpu() waits for the kernels that wrote it."""
    host = t.detach().to("cpu", copy=True, memory_format=torch.contiguous_format)
    reducer(host.numpy())  # the NumPy view shares host's memory: summed in place
    return host if t.device.type == "cpu" else host.to(t.device)


def convert(module: Any, reducer: Any) -> Any:
    """module with every BatchNorm layer (torch.nn.modules.batchnorm._BatchNorm: 1d, 2d, 3d,
    torch's and hvd's SyncBatchNorm) replaced by a SyncBatchNorm over reducer, holding the
    same parameter and buffer tensors under the same state-dict keys; torch.nn.SyncBatchNorm.
    convert_sync_batchnorm's rule. Converts in place below the top; returns the top."""
    out = module
    if isinstance(module, _BatchNorm) and type(module) is not SyncBatchNorm:
        out = SyncBatchNorm(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            reducer,
        )
        if module.affine:
            out.weight, out.bias = module.weight, module.bias
        out.running_mean = module.running_mean
        out.running_var = module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.training = module.training
    for name, child in module.named_children():
        out.add_module(name, convert(child, reducer))
    return out
