"""hpcdl's own engine behind the seam (NOTE [the engine seam] in hpcdl/engine.py): an hpcdl.nn
Model on NumPy or CuPy, stepped by hpcdl.nn.step.train_step.

Built exactly as hpcdl.startup built it before the seam (same order of collectives, same
broadcasts), so its runs are bitwise what they were."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import numpy as np

from hpcdl import nn, resume
from hpcdl.comm import collectives
from hpcdl.comm.failure import agree_on_errors
from hpcdl.comm.reducer import GradientReducer
from hpcdl.comm.world import World
from hpcdl.config import TrainConfig
from hpcdl.data.device import on_device
from hpcdl.engine import tf32_unused
from hpcdl.nn.step import StepParts, StepResult, train_step
from hpcdl.nn.step_graph import StepGraph
from hpcdl.resume import shapes
from hpcdl.run import own
from hpcdl.startup_checks import verify_same_run

PLAIN_KERNELS = "hpcdl's plain kernels (add --gpu-kernels)"  # --tf32's matrix products: cuBLAS's


@dataclass
class ArrayEngine:
    """An hpcdl.nn Model, its fused optimizer and the step's reducers (StepParts)."""

    parts: StepParts
    world: World
    host_staged: bool  # collectives go through host memory (GPU without a CUDA-aware MPI)
    kind: str = "hpcdl"

    @property
    def model(self) -> Any:
        return self.parts.model

    @property
    def optimizer(self) -> Any:
        return self.parts.optimizer

    @property
    def xp(self) -> Any:
        return self.parts.xp

    @property
    def scaler(self) -> Any:
        return self.parts.scaler

    @property
    def precision_line(self) -> str:
        precision = self.model.precision
        scaling = ", dynamic loss scaling" if precision == "fp16" else ""
        return (
            f"hpcdl: precision {precision}: activations and gradients rounded to {precision}, "
            f"float32 master weights{scaling} (float32 arrays: {precision}'s accuracy, not its "
            "speed)"
        )

    @property
    def tf32_line(self) -> str | None:
        if self.xp is np:
            return tf32_unused("a CPU")
        return None if nn.kernels.enabled() else tf32_unused(PLAIN_KERNELS)

    @property
    def flags_agreed(self) -> bool:
        reducer = self.parts.reducer
        return reducer is not None and reducer.grads.size > self.model.grads.size

    def batches(self, host: Iterable, decoded: bool = False) -> Iterable:
        return host if decoded else on_device(host, self.xp)  # decoded: on xp already

    def step(
        self, images: Any, labels: Any, lr: float, mix_params: bool, waited_since: float,
        timed: bool,
    ) -> StepResult:  # fmt: skip
        return train_step(self.parts, images, labels, lr, mix_params, waited_since, timed)

    def correct(self, logits: Any, labels: Any) -> Any:
        return nn.accuracy_count(logits, labels)

    def evaluate(self, images: Any, labels: Any) -> tuple[float, int]:
        logits = self.model.forward(images, train=False)
        loss, _ = nn.softmax_cross_entropy(logits, labels)
        return float(loss), int(nn.accuracy_count(logits, labels))

    def average_buffers(self) -> None:
        collectives.allreduce_mean(self.world.comm, self.model.buffers, self.host_staged)


def build(
    cfg: TrainConfig,
    world: World,
    stack: ExitStack,
    built: Any,
    input_shape: tuple[int, int, int],
    num_classes: int,
    xp: Any,
    host_staged: bool,
) -> ArrayEngine:
    """The engine for --model, the same on every rank; collective. built: what a user's
    builder returned (hpcdl.engines called it), None for a built-in name."""
    model, optimizer = build_model(cfg, world, built, input_shape, num_classes, xp, host_staged)
    scaler = loss_scaler(cfg, world, stack)
    parts = step_parts(cfg, world, stack, model, optimizer, xp, host_staged, scaler)
    return ArrayEngine(parts, world, host_staged)


def build_model(
    cfg: TrainConfig,
    world: World,
    built: Any,
    input_shape: tuple[int, int, int],
    num_classes: int,
    xp: Any,
    host_staged: bool,
):
    """(model, optimizer), the same on every rank: --model for the shape the loaders yield;
    rank 0's parameters and BatchNorm statistics are broadcast after the ranks agreed on
    configuration and shapes. A builder that fails (a user's, `module:function`) stops every
    rank with one line."""
    model, error = None, None
    if cfg.gpu_kernels:
        nn.kernels.enable(True)
    if cfg.tf32:  # or HPCDL_TF32=1; NOTE [TF32]: before the first plan is built
        nn.kernels.allow_tf32(True)
    try:
        if built is None:
            model = nn.build_model(cfg.model, input_shape, num_classes, seed=cfg.seed, xp=xp)
        else:
            model = nn.user_models.as_model(cfg.model, built, input_shape, num_classes,
                                            seed=cfg.seed, xp=xp)  # fmt: skip
        model.set_precision(cfg.precision)
    except ValueError as exc:
        error = f"--{exc}"
    agree_on_errors(world.comm, world.rank, error)
    init_from(cfg, world, model)
    model.set_rng_state(nn.rank_rng_state(cfg.seed, world.rank))
    verify_same_run(world, cfg, shapes(model))
    collectives.broadcast(world.comm, model.params, host_staged=host_staged)
    collectives.broadcast(world.comm, model.buffers, host_staged=host_staged)
    optimizer = nn.make_optimizer(
        cfg.optimizer,
        model.params,
        model.grads,
        momentum=cfg.momentum,
        nesterov=cfg.nesterov,
        weight_decay=cfg.weight_decay,
        decay_mask=None if cfg.decay_bias_norm else model.decay_mask(),
    )
    return model, optimizer


# --- --init-from (issue 27) and the step's reducers ---


def init_from(cfg: TrainConfig, world: World, model: Any) -> None:
    """--init-from (hpcdl.resume.init_from): the file's weights into rank 0's model; a
    classifier of another class count is re-initialised, and rank 0 says so. Collective."""
    from hpcdl.nn import weights_io  # noqa: PLC0415

    source = f"--init-from {cfg.init_from}"
    resume.init_from(cfg, world, lambda state: weights_io.load_state(model, state, source))


def step_parts(
    cfg: TrainConfig,
    world: World,
    stack: ExitStack,
    model: Any,
    optimizer: Any,
    xp: Any,
    host_staged: bool,
    scaler: Any = None,
) -> StepParts:
    """The step's reducers: gradient buckets (--sync grad), or parameter averaging (--sync
    params:K); with --sync-bn, BatchNorm sums its batch statistics over the ranks. scaler:
    --precision fp16's loss scaler (loss_scaler)."""
    if cfg.sync_bn and world.size > 1:
        bn_stats = collectives.SumReducer(world.comm, host_staged=host_staged)
        own(stack, bn_stats.close, None)  # alone: its communicator is left to MPI_Abort
        model.set_stat_reducer(bn_stats)
    reducer = None
    if world.size > 1 and cfg.params_sync_every == 0:
        reducer = GradientReducer(
            world.comm,
            model.grads_and_flags,
            cfg.bucket_mb,
            host_staged=host_staged,
            prescaled=True,
        )
        own(stack, reducer.close, None)  # alone: its thread may be inside an Allreduce

    def average_params() -> None:
        collectives.allreduce_mean(world.comm, model.params, host_staged)

    graph = StepGraph() if cfg.gpu_kernels else None  # NOTE [step graphs]
    return StepParts(model, optimizer, xp, reducer, average_params, scaler, graph=graph)


def loss_scaler(cfg: TrainConfig, world: World, stack: ExitStack) -> Any:
    """--precision fp16: the dynamic loss scaler, agreeing on overflows over the ranks."""
    from hpcdl import nn  # noqa: PLC0415

    if cfg.precision != "fp16":
        return None
    # Overflows are expected at fp16 (the scaler skips those steps and counts them in the
    # summary): NumPy's warnings about them would only alarm.
    warnings.filterwarnings(
        "ignore", message="(overflow|invalid value) encountered", category=RuntimeWarning
    )
    any_rank = None  # the gradient allreduce carries the overflow flag, but not with params:K
    if world.size > 1 and cfg.params_sync_every:
        any_rank = collectives.AnyRank(world.comm)
        own(stack, any_rank.close, None)
    return nn.precision.LossScaler(any_rank)
