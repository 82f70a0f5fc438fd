"""Start-up steps of a training run that must agree across ranks: data, model, resume.

Each step does purely local checks first and then agrees collectively (agree_on_errors), so a
problem seen by one rank stops every rank, and a problem seen by all is printed once.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from hpcdl import checkpoint
from hpcdl.backend import to_device, to_host
from hpcdl.comm.failure import SystemExitWithMessage, agree_on_errors
from hpcdl.comm.world import World
from hpcdl.config import TrainConfig
from hpcdl.data.sampler import DistributedSampler


def env_rank() -> int:
    """This process's world rank as announced by the launcher (0 for a singleton)."""
    for key in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"):
        value = os.environ.get(key)
        if value is not None and value.isdigit():
            return int(value)
    return 0


QUIET_RANK_EXIT_DELAY_S = 2.0


def fail_once(message: str | None, comm: Any = None, status: int = 2) -> int:
    """Print a user-facing error from rank 0 only and return the exit status for every rank.

    The launcher ends the whole job as soon as the first rank exits non-zero, so rank 0's
    message must be out before any rank exits: with MPI running (comm given) all ranks meet in
    a barrier after the print; before MPI is initialised the quiet ranks wait a moment."""
    rank = env_rank() if comm is None else comm.Get_rank()
    if rank == 0 and message:
        print(message, file=sys.stderr, flush=True)
    if comm is not None:
        comm.Barrier()
    elif rank != 0:
        time.sleep(QUIET_RANK_EXIT_DELAY_S)
    return status


def _local_error(fn) -> tuple[Any, str | None]:
    try:
        return fn(), None
    except (OSError, ValueError, KeyError) as exc:
        return None, str(exc)


def open_datasets(cfg: TrainConfig, world: World) -> tuple[Any, Any | None]:
    """Open --data and --val-data on every rank; any failure stops all ranks with one message."""
    from hpcdl.data import open_dataset  # noqa: PLC0415

    train_ds, error = _local_error(lambda: open_dataset(cfg.data))
    val_ds = None
    if error is None and cfg.val_data:
        val_ds, error = _local_error(lambda: open_dataset(cfg.val_data))
    if error is None:
        per_rank = len(train_ds) // world.size
        if cfg.batch_size > per_rank:
            error = (
                f"--batch-size {cfg.batch_size} is larger than each rank's shard of {cfg.data} "
                f"({len(train_ds)} samples / {world.size} ranks = {per_rank}); "
                f"use a batch size <= {per_rank} or fewer ranks"
            )
    if error is None and val_ds is not None:
        if tuple(val_ds.sample_shape) != tuple(train_ds.sample_shape):
            error = (
                f"--val-data {cfg.val_data} has samples of shape {tuple(val_ds.sample_shape)}, "
                f"--data has {tuple(train_ds.sample_shape)}"
            )
    agree_on_errors(world.comm, world.rank, error)
    return train_ds, val_ds


def make_sampler(cfg: TrainConfig, world: World, num_samples: int) -> DistributedSampler:
    return DistributedSampler(
        num_samples=num_samples,
        world_size=world.size,
        rank=world.rank,
        seed=cfg.seed,
        shuffle=cfg.shuffle,
        ranks_per_node=world.local_size,
    )


def run_fingerprint(cfg: TrainConfig, layout: list[tuple[str, tuple[int, ...]]]) -> str:
    text = cfg.to_json() + json.dumps([[n, list(s)] for n, s in layout])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def verify_same_run(world: World, cfg: TrainConfig, layout: list) -> None:
    """All ranks must build the same model from the same configuration."""
    prints = world.comm.allgather(run_fingerprint(cfg, layout))
    differing = [r for r, p in enumerate(prints) if p != prints[0]]
    if differing:
        error = (
            f"ranks {differing} run a different model or configuration than rank 0; "
            "start every rank with the same flags, config file and hpcdl version"
        )
        raise SystemExitWithMessage(error if world.rank == 0 else None)


def find_resume_checkpoint(cfg: TrainConfig) -> Path | None:
    if cfg.resume == "none":
        return None
    if cfg.resume == "auto":
        return checkpoint.latest(cfg.checkpoint_dir)
    return Path(cfg.resume)


def restore(cfg: TrainConfig, world: World, model: Any, optimizer: Any) -> tuple[int, int, int]:
    """Load --resume's checkpoint on every rank; returns (epoch, step_in_epoch, global_step)."""
    path = find_resume_checkpoint(cfg)
    ckpt, error = None, None
    if path is not None:
        try:
            ckpt = checkpoint.load(path)
            checkpoint.check_compatible(ckpt, path, model.name, shapes(model))
        except checkpoint.CheckpointError as exc:
            error = str(exc)
    agree_on_errors(world.comm, world.rank, error)
    if ckpt is None:
        return 0, 0, 0
    model.params[...] = to_device(ckpt.params, _xp(model.params))
    if ckpt.buffers.size:
        model.buffers[...] = to_device(ckpt.buffers, _xp(model.buffers))
    optimizer.load_state_dict(ckpt.optimizer)
    # Dropout streams are per rank; with another world size each rank keeps its fresh stream
    # (parameters and optimizer state carry over, the data order follows the new world size).
    if ckpt.world_size == world.size:
        model.set_rng_state(ckpt.rng_states[world.rank])
    return ckpt.epoch, ckpt.step_in_epoch, ckpt.global_step


def save(
    cfg: TrainConfig,
    world: World,
    model: Any,
    optimizer: Any,
    epoch: int,
    step_in_epoch: int,
    global_step: int,
) -> Path | None:
    """Collective: gather every rank's RNG state; rank 0 writes the checkpoint. Returns its path."""
    rng_states = world.comm.gather(model.get_rng_state(), root=0)
    path = None
    if world.is_root:
        state = {k: to_host(v) for k, v in optimizer.state_dict().items()}
        ckpt = checkpoint.Checkpoint(
            model=model.name,
            layout=shapes(model),
            params=to_host(model.params).copy(),
            buffers=to_host(model.buffers).copy(),
            optimizer=state,
            epoch=epoch,
            step_in_epoch=step_in_epoch,
            global_step=global_step,
            rng_states=rng_states,
            config=json.loads(cfg.to_json()),
            world_size=world.size,
        )
        path = checkpoint.save(cfg.checkpoint_dir, ckpt)
    return world.comm.bcast(path, root=0)


def shapes(model: Any) -> list[tuple[str, tuple[int, ...]]]:
    return [(name, tuple(shape)) for name, shape, _ in model.layout()]


def _xp(array: Any):
    from hpcdl.backend import array_module  # noqa: PLC0415

    return array_module(array)
