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
    """Open --data and --val-data; any failure stops all ranks with one message.

    Rank 0 opens them, building an image folder's index or loading it from its cache, and
    broadcasts the index: the job opens each image file once, in one process (NOTE [the index]
    in hpcdl/data/imagefolder.py). The first rank of every other node writes the index to its
    node's cache, where its loader workers look for it. Other data sets (HDF5) are opened on
    every rank. The validation labels are remapped onto the training classes by name
    (align_classes)."""
    from hpcdl.data import open_dataset  # noqa: PLC0415
    from hpcdl.data.dataset import align_classes  # noqa: PLC0415
    from hpcdl.data.imagefolder import ImageFolderDataset  # noqa: PLC0415

    paths = [cfg.data, *([cfg.val_data] if cfg.val_data else [])]
    shared = None
    if world.is_root:
        opened, error = _local_error(lambda: [open_dataset(p) for p in paths])
        indexes = [(d.index, d.index_path) if d.kind == "folder" else None for d in opened or []]
        shared = (error, indexes)
    error, indexes = world.comm.bcast(shared, root=0)

    def receive(path: str, index: tuple | None) -> Any:
        if index is None:
            return open_dataset(path)
        ds = ImageFolderDataset(path, index=index[0])
        if world.local_rank == 0 and world.node_index != 0:
            ds.ensure_cached(index[1])
        else:
            ds.index_path = index[1]
        return ds

    if not world.is_root and error is None:
        opened, error = _local_error(lambda: [receive(*pi) for pi in zip(paths, indexes)])
    train_ds, val_ds = (opened + [None])[:2] if error is None else (None, None)
    if error is None:
        per_rank = len(train_ds) // world.size
        if cfg.batch_size > per_rank:
            error = (
                f"--batch-size {cfg.batch_size} is larger than each rank's shard of {cfg.data} "
                f"({len(train_ds)} samples / {world.size} ranks = {per_rank}); "
                f"use a batch size <= {per_rank} or fewer ranks"
            )
    if error is None and val_ds is not None:
        error = _shape_error(cfg, train_ds, val_ds)
    if error is None and val_ds is not None:
        _, error = _local_error(lambda: align_classes(val_ds, train_ds))
    agree_on_errors(world.comm, world.rank, error)  # also: every node's cache is written
    return train_ds, val_ds


def input_shape(cfg: TrainConfig, ds: Any) -> tuple[int, int, int]:
    """(C, H, W) of the samples the loaders yield for ds under --augment: the model's input."""
    from hpcdl.data.augment import parse_augment  # noqa: PLC0415
    from hpcdl.data.batch import output_shape  # noqa: PLC0415

    return output_shape(ds, parse_augment(cfg.augment))


def build_model(cfg: TrainConfig, world: World, train_ds: Any, xp: Any) -> Any:
    """--model for the shape the loaders yield (input_shape), on every rank; a builder that
    fails (a user's, `module:function`) stops every rank with one line."""
    from hpcdl import nn  # noqa: PLC0415

    model, error = None, None
    try:
        model = nn.build_model(
            cfg.model, input_shape(cfg, train_ds), train_ds.num_classes, seed=cfg.seed, xp=xp
        )
    except ValueError as exc:
        error = f"--{exc}"
    agree_on_errors(world.comm, world.rank, error)
    return model


def _shape_error(cfg: TrainConfig, train_ds: Any, val_ds: Any) -> str | None:
    """Training and validation batches must have one shape, the model's input shape."""
    train_shape, val_shape = input_shape(cfg, train_ds), input_shape(cfg, val_ds)
    if train_shape == val_shape:
        return None
    fix = (
        "give --val-data images with the same number of channels"
        if train_shape[0] != val_shape[0]
        else "use --augment rcropS or rrcS to crop both to S x S, or images of the same size"
    )
    return (
        f"--val-data {cfg.val_data} yields samples of shape {val_shape} with --augment "
        f"{cfg.augment}, --data {cfg.data} yields {train_shape}; {fix}"
    )


def make_sampler(cfg: TrainConfig, world: World, num_samples: int) -> DistributedSampler:
    return DistributedSampler(
        num_samples=num_samples,
        world_size=world.size,
        rank=world.rank,
        seed=cfg.seed,
        shuffle=cfg.shuffle,
        ranks_by_node=world.ranks_by_node,
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


def check_outputs(cfg: TrainConfig, world: World) -> None:
    """--metrics must be a file rank 0 can create or append to, --checkpoint-dir a directory.

    Checked on rank 0 (the only writer) without creating anything; every rank stops on an
    error, rank 0 prints it."""
    error = world.comm.bcast(_output_error(cfg) if world.is_root else None, root=0)
    if error:
        raise SystemExitWithMessage(error if world.is_root else None)


def _output_error(cfg: TrainConfig) -> str | None:
    if cfg.metrics:
        metrics = Path(cfg.metrics)
        if metrics.is_dir():
            return (
                f"--metrics {metrics} is a directory; give a file name such as "
                f"{metrics / 'metrics.jsonl'}"
            )
        parent = _nearest_existing(metrics.parent)
        if not parent.is_dir():
            return f"--metrics {metrics} cannot be created: {parent} is not a directory"
        target = metrics if metrics.exists() else parent
        if not os.access(target, os.W_OK):
            return f"--metrics {metrics} cannot be written: no write permission on {target}"
    if cfg.checkpoint_dir:
        ckpt_dir = Path(cfg.checkpoint_dir)
        if ckpt_dir.exists() and not ckpt_dir.is_dir():
            return f"--checkpoint-dir {ckpt_dir} is a file; give a directory (created if missing)"
    return None


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def find_resume_checkpoint(cfg: TrainConfig) -> Path | None:
    if cfg.resume == "none":
        return None
    if cfg.resume == "auto":
        return checkpoint.latest(cfg.checkpoint_dir)
    return Path(cfg.resume)


def restore(cfg: TrainConfig, world: World, model: Any, optimizer: Any) -> tuple[int, int, int]:
    """Load --resume's checkpoint on every rank; returns (epoch, step_in_epoch, global_step).

    Everything that can be wrong with the file (a missing attribute, another model's or another
    optimizer's state, a vector of the wrong length, a garbage RNG state) is found while loading
    it into the model on each rank, and agreed: one line naming the file, every rank stops."""
    path = find_resume_checkpoint(cfg)
    ckpt, error = None, None
    if path is not None:
        try:
            ckpt = checkpoint.load(path)
            checkpoint.check_compatible(
                ckpt, path, model.name, shapes(model), buffer_values=int(model.buffers.size)
            )
            _load_state(ckpt, path, cfg, world, model, optimizer)
        except checkpoint.CheckpointError as exc:
            error = str(exc)
    agree_on_errors(world.comm, world.rank, error)
    if ckpt is None:
        return 0, 0, 0
    return ckpt.epoch, ckpt.step_in_epoch, ckpt.global_step


def _load_state(
    ckpt: checkpoint.Checkpoint, path: Path, cfg: TrainConfig, world: World, model, optimizer
) -> None:
    """Copy a compatible checkpoint into model and optimizer; CheckpointError if it cannot."""
    model.params[...] = to_device(ckpt.params, _xp(model.params))
    if ckpt.buffers.size:
        model.buffers[...] = to_device(ckpt.buffers, _xp(model.buffers))
    kept = sorted(optimizer.state_dict())
    if sorted(ckpt.optimizer) != kept:
        saved_with = ckpt.config.get("optimizer")
        hint = (
            f"resume with --optimizer {saved_with}, the one it was saved with,"
            if saved_with and saved_with != cfg.optimizer
            else "resume from a checkpoint of this optimizer"
        )
        raise checkpoint.CheckpointError(
            f"checkpoint {path} holds the state of another optimizer "
            f"({', '.join(sorted(ckpt.optimizer))}), not what --optimizer {cfg.optimizer} keeps "
            f"({', '.join(kept)}); {hint} or start without --resume"
        )
    try:
        optimizer.load_state_dict(ckpt.optimizer)
    except (TypeError, ValueError) as exc:
        raise checkpoint.CheckpointError(
            f"checkpoint {path}: {exc}; {checkpoint.DAMAGED}"
        ) from None
    # Dropout streams are per rank; with another world size each rank keeps its fresh stream
    # (parameters and optimizer state carry over, the data order follows the new world size).
    if ckpt.world_size == world.size:
        try:
            model.set_rng_state(ckpt.rng_states[world.rank])
        except (TypeError, ValueError, KeyError) as exc:
            raise checkpoint.CheckpointError(
                f"checkpoint {path} has an unusable dropout RNG state ({exc}); {checkpoint.DAMAGED}"
            ) from None


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
