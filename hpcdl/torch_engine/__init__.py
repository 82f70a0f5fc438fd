"""hpcdl.train's torch engine (NOTE [the engine seam] in hpcdl/engine.py): a torch.nn.Module
trained by hpcdl's loop, the only module of a run that imports torch.

NOTE [a module in flat vectors]
The module's parameters become views of one float32 vector, in reverse registration order
(backward finishes the last layers first), its float buffers (BatchNorm statistics) views of a
second, and each parameter's .grad a view of a third that ends with the step's flags
(hpcdl.nn.model.FLAG_LOSS, FLAG_OVERFLOW), as hpcdl's own Model lays them out. So:
- hpcdl.comm.reducer.GradientReducer, the reducer hpcdl.torch and hpcdl's engine use, averages
  that third vector's NumPy view (torch.from_numpy shares memory on the CPU) bucket by bucket:
  a post-accumulate-grad hook marks the longest prefix whose gradients are final, and the
  reducer's thread reduces the buckets inside it while backward goes on; the non-finite-loss
  flag rides in the last bucket, so every rank sees every rank's;
- autograd accumulates into the existing .grad in place (it is zeroed before each backward),
  so the gradients land in the reducer's buffer with no copy;
- checkpoints hold the parameters, buffers and the torch.optim state as flat vectors in
  hpcdl.checkpoint's file (model layout by parameter name), and `--resume auto` restores them
  bit for bit: the optimizer's per-parameter state tensors are rebuilt from their slices;
- --sync-bn swaps the BatchNorm layers (sync_batch_norm.convert) before the module is laid
  out, keeping their tensors, so the vectors' views are the new layers' own.
With --device gpu the vectors live on the rank's CUDA device and the reducer gets their CuPy
view, as hpcdl.torch's DistributedOptimizer hands it its flat buffers (device buffers to a
CUDA-aware MPI, else staged through pinned memory); each mark_ready runs on torch's current
stream (device.OnTorchStream), so the reducer's per-bucket event follows backward's kernels
and it reads a bucket only once they have written it. Checkpoints copy the vectors to the host.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from hpcdl import diag
from hpcdl.backend import array_module
from hpcdl.comm import collectives
from hpcdl.comm.failure import agree_on_errors
from hpcdl.comm.reducer import GradientReducer
from hpcdl.comm.world import World
from hpcdl.config import TrainConfig
from hpcdl.engine import tf32_unused
from hpcdl.nn.model import FLAG_LOSS, FLAG_OVERFLOW
from hpcdl.nn.precision import LossScaler
from hpcdl.nn.step import StepResult, StepTimes
from hpcdl.resume import shapes
from hpcdl.run import own
from hpcdl.startup_checks import verify_same_run
from hpcdl.torch_engine import device, sync_batch_norm
from hpcdl.torch_engine.flat import FlatModule
from hpcdl.torch_engine.optim import FlatOptimizer
from hpcdl.torch_engine.specs import init_from, refused, seed_all, torchvision_model

__all__ = ["TorchEngine", "build", "seed_all"]


@dataclass
class TorchEngine:
    """A torch.nn.Module in flat vectors (FlatModule), torch.optim over it, hpcdl's reducer."""

    model: FlatModule
    optimizer: FlatOptimizer
    world: World
    reducer: GradientReducer | None
    kind: str = "torch"
    xp: Any = np  # the step's loss and flags: NumPy views of CPU tensors, CuPy on a GPU
    scaler: Any = None  # --precision fp16: hpcdl.nn.precision.LossScaler (loss_scaler)
    autocast: Any = None  # --precision bf16|fp16: torch.autocast's dtype; else None
    feed: device.BatchFeed = field(
        default_factory=lambda: device.BatchFeed(torch.device("cpu"))
    )  # where batches go (hpcdl/torch_engine/device.py)
    host_staged: bool = False  # --device gpu, MPI not CUDA-aware: collectives through the host

    @property
    def precision_line(self) -> str:
        if self.scaler is not None:
            return (
                "hpcdl: precision fp16: forward and loss under torch.autocast (float16 matrix "
                "products and convolutions), float32 parameters and gradients; dynamic loss "
                "scaling, a step whose gradients overflowed on any rank is skipped on every "
                "rank and counted (skipped_steps)"
            )
        return (
            "hpcdl: precision bf16: forward and loss under torch.autocast (bfloat16 matrix "
            "products and convolutions), float32 parameters and gradients"
        )

    @property
    def tf32_line(self) -> str | None:
        return None if self.feed.device.type == "cuda" else tf32_unused("a CPU")

    @property
    def flags_agreed(self) -> bool:
        return self.reducer is not None

    def batches(self, host: Iterable, decoded: bool = False) -> Iterable:
        """The loader's batches as tensors: on the CPU sharing their memory (no copy); on a GPU
        NumPy pinned and copied on their own stream, CuPy (decoded) through DLPack, on
        torch's current stream (device.BatchFeed)."""
        return self.feed(host, decoded)

    def step(
        self, images: Any, labels: Any, lr: float, mix_params: bool, waited_since: float,
        timed: bool,
    ) -> StepResult:  # fmt: skip
        t0 = time.perf_counter()
        start = t0 if waited_since is None else waited_since
        model, reducer = self.model, self.reducer
        model.grads_and_flags.zero_()
        with self._precision():
            logits = model.module(images)
            loss = F.cross_entropy(logits.float(), labels)
        model.flags[FLAG_LOSS] = (~torch.isfinite(loss.detach())).float()
        model.flags[FLAG_OVERFLOW] = 0.0
        tf = time.perf_counter()
        diag.record(diag.Kind.FORWARD, t0, tf)
        if reducer is not None:
            reducer.begin_step()
        mark_ready = reducer.mark_ready if reducer is not None else None
        if mark_ready is not None and model.device.type == "cuda":
            mark_ready = device.OnTorchStream(mark_ready, model.device)
        if self.scaler is not None:  # count overflows before the reducer sums them
            mark_ready = OverflowCount(model.grads, model.flags, mark_ready)
        model.begin_backward(mark_ready)
        # gradients of loss / N: their sum over the ranks is the average; x the loss scale
        scale = (1.0 / self.world.size if reducer is not None else 1.0) * (
            self.scaler.scale if self.scaler is not None else 1.0
        )
        (loss * scale if scale != 1.0 else loss).backward()
        if isinstance(mark_ready, OverflowCount):
            mark_ready.finish()
        t1 = time.perf_counter()
        diag.record(diag.Kind.BACKWARD, tf, t1)
        if reducer is not None:
            diag.RECORDER.enter(diag.Kind.COMM_WAIT, t1)  # the stall inspector sees this wait
            reducer.wait()
        t2 = time.perf_counter()
        diag.record(diag.Kind.COMM_WAIT, t1, t2)
        applied = True
        if self.scaler is not None:  # the allreduce summed every rank's overflow count
            overflows = model.flags_host[FLAG_OVERFLOW]
            applied = self.scaler.unscale(model.grads_host, overflows, reducer is not None)
        if applied:
            self.optimizer.step(lr)
        if mix_params:  # --sync params:K: the mean of the ranks' parameters every K steps
            collectives.allreduce_mean(self.world.comm, model.params, self.host_staged)
        t3 = time.perf_counter()
        diag.record(diag.Kind.OPTIMIZER, t2, t3)
        times = StepTimes(t0 - start, t1 - t0, t2 - t1, t3 - t2, t3 - start)
        flags = model.flags_host[FLAG_LOSS].copy()
        loss = device.as_array(loss.detach())  # a GPU's: read when the metrics are written
        return StepResult(loss, logits.detach(), times, applied, flags)

    def correct(self, logits: Any, labels: Any) -> Any:
        return device.as_array((logits.argmax(dim=1) == labels).sum())

    def evaluate(self, images: Any, labels: Any) -> tuple[float, int]:
        module = self.model.module
        module.eval()
        try:
            with torch.no_grad(), self._precision():
                logits = module(images)
                loss = F.cross_entropy(logits.float(), labels)
        finally:
            module.train()
        return float(loss), int(self.correct(logits, labels))

    def _precision(self) -> Any:
        """--precision bf16|fp16: forward and loss under autocast (float32 parameters and
        gradients, bfloat16 or float16 matrix products and convolutions); fp32: nothing."""
        return device.precision(self.feed.device, self.autocast)

    def average_buffers(self) -> None:
        collectives.allreduce_mean(self.world.comm, self.model.buffers, self.host_staged)


def build(
    cfg: TrainConfig,
    world: World,
    stack: ExitStack,
    built: Any,
    input_shape: tuple[int, int, int],
    num_classes: int,
    host_staged: bool,
) -> TorchEngine:
    """The torch engine for --model, the same on every rank; collective. built: the module a
    user's builder returned, None for `torchvision:NAME` (built here). host_staged: --device
    gpu without a CUDA-aware MPI (start-up's hpcdl.comm.cuda_aware decision): device buffers
    go through pinned host memory, as for hpcdl.torch's DistributedOptimizer, else to MPI
    directly. Flags it cannot serve yet, a module it cannot train and a torchvision name that
    does not exist stop every rank with one line."""
    model, error = None, refused(cfg)
    where, no_device = device.torch_device(cfg.device, cfg.model, world.local_rank)
    error = error or no_device
    bn_sums = batch_norm_sums(cfg, world, stack)
    if error is None:
        try:
            module = built if built is not None else torchvision_model(cfg, num_classes)
            if bn_sums is not None:  # before FlatModule makes its tensors views of the vectors
                module = sync_batch_norm.convert(module, bn_sums)
            model = FlatModule(module, cfg, input_shape, num_classes, where)
        except ValueError as exc:
            error = str(exc)
    agree_on_errors(world.comm, world.rank, error)
    device.use_cpu_threads(world.node_comm)  # torch's pool follows the CPU mask, not the node
    init_from(cfg, world, model)
    model.set_rng_state(model.seeded_rng_state(cfg.seed + world.rank))  # dropout: per rank
    verify_same_run(world, cfg, shapes(model))
    collectives.broadcast(world.comm, model.params, host_staged=host_staged)
    collectives.broadcast(world.comm, model.buffers, host_staged=host_staged)
    reducer = None  # one rank, or --sync params:K (TorchEngine.step averages the parameters)
    if world.size > 1 and cfg.params_sync_every == 0:
        grads = device.as_array(model.grads_and_flags)
        reducer = GradientReducer(world.comm, grads, cfg.bucket_mb, host_staged, prescaled=True)
        own(stack, reducer.close, None)  # alone: its thread may be inside an Allreduce
    autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision)
    scaler = loss_scaler(cfg, world, stack, reducer)
    optimizer = FlatOptimizer(cfg, model)
    if cfg.tf32:  # else PyTorch's defaults stand
        device.set_fp32_precision(True)
    feed = device.BatchFeed(where, device.use_channels_last(model.module, where))
    xp = np if where.type == "cpu" else array_module(model.params)
    return TorchEngine(
        model, optimizer, world, reducer, xp=xp, scaler=scaler, autocast=autocast, feed=feed,
        host_staged=host_staged,
    )  # fmt: skip


def batch_norm_sums(cfg: TrainConfig, world: World, stack: ExitStack) -> Any:
    """--sync-bn on more than one rank: the SumReducer (its own duplicate of the World's
    communicator) every SyncBatchNorm sums its statistics over, owned by the run; else None.
    Collective. Host arrays only (sync_batch_norm stages a GPU's few KB through the host)."""
    if not cfg.sync_bn or world.size == 1:
        return None
    sums = collectives.SumReducer(world.comm)
    own(stack, sums.close, None)  # alone: its communicator is left to MPI_Abort
    return sums


def loss_scaler(
    cfg: TrainConfig, world: World, stack: ExitStack, reducer: GradientReducer | None
) -> LossScaler | None:
    """--precision fp16: hpcdl's dynamic loss scaler (hpcdl.nn.precision), the rules of hpcdl's
    engine. The overflow count rides the gradient allreduce; with --sync params:K (no
    gradient allreduce) one agreed collective (AnyRank) decides."""
    if cfg.precision != "fp16":
        return None
    any_rank = None
    if world.size > 1 and reducer is None:
        any_rank = collectives.AnyRank(world.comm)
        own(stack, any_rank.close, None)
    return LossScaler(any_rank)


class OverflowCount:
    """The hooks' mark_ready for fp16: adds to flags[FLAG_OVERFLOW] whether each newly final
    gradient range holds an inf or NaN, then hands it on to the reducer (which sums it in
    place, so it is counted first). finish() counts the rest once backward has ended."""

    def __init__(self, grads: Any, flags: Any, mark_ready: Any) -> None:
        self.grads, self.flags, self.mark_ready = grads, flags, mark_ready
        self.checked = 0  # grads[:checked] are counted

    def __call__(self, n: int) -> None:
        if n > self.checked:  # on the device, no host read: 1.0 where a value is not finite
            self.flags[FLAG_OVERFLOW] += (
                ~torch.isfinite(self.grads[self.checked : n]).all()
            ).float()
            self.checked = n
        if self.mark_ready is not None:
            self.mark_ready(n)

    def finish(self) -> None:
        self(self.grads.numel())
