"""hvd.SyncBatchNorm: batch normalisation over the whole global batch (every rank's samples).

The batch statistics are sums over all ranks, taken with the differentiable allreduce
(hpcdl.torch.autograd): the per-channel sum and count, then the sum of squared deviations from
the global mean (two passes: no cancellation in E[x^2] - E[x]^2). The gradient then needs no
code of its own: the allreduce's backward sums the gradients that flow into the statistics over
the ranks, which is exactly the global batch's gradient. So every rank must run forward and
backward, as with Horovod's. Unlike Horovod's (GPU only), CPU tensors work too. Evaluation
uses the running statistics, updated in training from the global mean and the unbiased global
variance, as torch's BatchNorm does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from hpcdl.torch.autograd import allreduce
from hpcdl.torch.process import Sum, size


class SyncBatchNorm(_BatchNorm):
    """Horovod's SyncBatchNorm (N-dimensional; input (N, C, ...))."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)

    def _check_input_dim(self, input: Any) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: Any) -> Any:
        self._check_input_dim(input)
        if self.training and self.track_running_stats:
            self.num_batches_tracked = self.num_batches_tracked + 1
        if not self.training and self.track_running_stats:
            return F.batch_norm(
                input,
                self.running_mean,
                self.running_var,
                self.weight,
                self.bias,
                False,
                0.0,
                self.eps,
            )
        if size() == 1:
            momentum = self._factor()
            return F.batch_norm(
                input,
                self.running_mean,
                self.running_var,
                self.weight,
                self.bias,
                True,
                momentum,
                self.eps,
            )
        return self._global_batch(input)

    def _factor(self) -> float:
        if self.momentum is None:  # a cumulative moving average
            return 1.0 / float(self.num_batches_tracked)
        return self.momentum

    def _global_batch(self, x: Any) -> Any:
        dims = [0, *range(2, x.dim())]
        shape = [1, x.shape[1]] + [1] * (x.dim() - 2)
        count = torch.tensor([x.numel() // x.shape[1]], dtype=x.dtype, device=x.device)
        totals = allreduce(torch.cat([x.sum(dims), count]), op=Sum, name=None)
        n = totals[-1]
        mean = totals[:-1] / n
        centered = x - mean.view(shape)
        var = allreduce((centered * centered).sum(dims), op=Sum) / n
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
