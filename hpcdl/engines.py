"""Which engine trains --model (NOTE [the engine seam] in hpcdl/engine.py): the one place that
asks. A torch.nn.Module, from `torchvision:NAME` or a user's builder, goes to
hpcdl.torch_engine (torch is imported only then); anything else to hpcdl.array_engine."""

from __future__ import annotations

import sys
from contextlib import ExitStack
from typing import Any

from hpcdl.comm.failure import agree_on_errors
from hpcdl.comm.world import World
from hpcdl.config import TrainConfig
from hpcdl.engine import Engine
from hpcdl.nn.user_models import call_builder, is_torch_module, is_torchvision, is_user_model


def build_engine(
    cfg: TrainConfig,
    world: World,
    stack: ExitStack,
    input_shape: tuple[int, int, int],
    num_classes: int,
    xp: Any,
    host_staged: bool,
) -> Engine:
    """The engine for --model on input_shape samples of num_classes, the same on every rank
    (rank 0's parameters broadcast); collective. A builder that fails stops every rank with
    one line."""
    built, error = None, None
    if is_user_model(cfg.model):
        if "torch" in sys.modules:  # a torch builder initialises from --seed
            seed_torch(cfg.seed)  # (every rank; rank 0's values are broadcast anyway)
        try:
            built = call_builder(cfg.model, input_shape, num_classes, seed=cfg.seed, xp=xp)
        except ValueError as exc:
            error = f"--{exc}"
    agree_on_errors(world.comm, world.rank, error)
    if is_torchvision(cfg.model) or is_torch_module(built):
        from hpcdl import torch_engine  # noqa: PLC0415

        if built is None:
            torch_engine.seed_all(cfg.seed)
        return torch_engine.build(cfg, world, stack, built, input_shape, num_classes, host_staged)
    from hpcdl import array_engine  # noqa: PLC0415

    return array_engine.build(cfg, world, stack, built, input_shape, num_classes, xp, host_staged)


def seed_torch(seed: int) -> None:
    """torch's generator from --seed before a user's builder runs; called only where torch is
    loaded already (the builder's file imported it), so hpcdl's models never import it."""
    from hpcdl import torch_engine  # noqa: PLC0415

    torch_engine.seed_all(seed)
