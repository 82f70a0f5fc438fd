"""hvd.SyncBatchNorm: batch normalisation over the whole global batch (every rank's samples).

The math is hpcdl.torch_engine.sync_batch_norm's (hpcdl.train's --sync-bn for torch models);
this flavour sums the statistics with hvd's differentiable allreduce (hpcdl.torch.autograd),
whose backward sums the gradients that flow into the statistics over the ranks, which is
exactly the global batch's gradient. So every rank must run forward and backward, as with
Horovod's. Unlike Horovod's (GPU only), CPU tensors work too. Evaluation uses the running
statistics, updated in training from the global mean and the unbiased global variance, as
torch's BatchNorm does.
"""

from __future__ import annotations

from typing import Any

from hpcdl.torch.autograd import allreduce
from hpcdl.torch.process import Sum, size
from hpcdl.torch_engine import sync_batch_norm


class SyncBatchNorm(sync_batch_norm.SyncBatchNorm):
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

    def _ranks(self) -> int:
        return size()

    def _sum_over_ranks(self, t: Any) -> Any:
        return allreduce(t, op=Sum, name=None)
