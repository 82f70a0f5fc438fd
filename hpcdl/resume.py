"""A run's checkpoints: where --resume continues (restore) and the one place they are written
(save). Both are collective; rank 0 writes, every rank reads (hpcdl.checkpoint: the file)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from hpcdl import checkpoint, diag
from hpcdl.backend import to_device, to_host
from hpcdl.comm.failure import SystemExitWithMessage, agree_on_errors
from hpcdl.comm.world import World
from hpcdl.config import TrainConfig
from hpcdl.data.epoch_order import EpochOrder, rest_of_epoch, rest_size, resume_batch
from hpcdl.data.sampler import SamplerSpec
from hpcdl.resume_changes import changes_line
from hpcdl.run import Position, RestOfEpoch, Run


def find_resume_checkpoint(cfg: TrainConfig) -> Path | None:
    if cfg.resume == "none":
        return None
    if cfg.resume == "auto":
        return checkpoint.latest(cfg.checkpoint_dir)
    return Path(cfg.resume)


def init_from(cfg: TrainConfig, world: World, load: Callable[[dict[str, Any]], list[str]]) -> None:
    """--init-from (issue 27): rank 0 reads the file's state dict and hands it to load, the
    engine's (it copies the weights into rank 0's model, which the engine then broadcasts, and
    returns lines to say, or raises ValueError: one line, every rank stops). A run that resumes
    takes its weights from the checkpoint instead, and the file is not read. Collective."""
    if not cfg.init_from:
        return
    resuming = find_resume_checkpoint(cfg)
    if resuming is not None:
        if world.is_root and not cfg.quiet:
            print(
                f"hpcdl: --init-from {cfg.init_from} not read: resuming from {resuming}", flush=True
            )
        return
    from hpcdl.nn import weights_io  # noqa: PLC0415

    error, lines = None, []
    if world.is_root:
        try:
            lines = load(weights_io.read_state(cfg.init_from))
        except ValueError as exc:
            error = str(exc)
    agree_on_errors(world.comm, world.rank, error)
    if world.is_root and not cfg.quiet:
        for line in [f"weights from {cfg.init_from}", *lines]:
            print(f"hpcdl: {line}", flush=True)


class NothingToTrain(SystemExitWithMessage):
    """The resumed checkpoint is where the run ends (the last job of a chain resumes a finished
    run): every rank leaves start-up together, rank 0 prints the message, the exit status is 0."""


def stop_if_finished(cfg: TrainConfig, start: Position) -> None:
    """Raise NothingToTrain on every rank when the resumed position is the end of the run.

    Before staging and loaders start: a stager asked to plan no epoch at all has nothing to do,
    and --max-steps already reached must not train one more step."""
    where = finished(cfg, start.epoch, start.global_step)
    if where:
        path = find_resume_checkpoint(cfg)
        raise NothingToTrain(f"hpcdl.train: nothing to train: checkpoint {path} {where}")


def finished(cfg: TrainConfig, epoch: int, global_step: int) -> str | None:
    """How a run at (epoch, global_step) has reached its end, or None while it has not."""
    if cfg.max_steps and global_step >= cfg.max_steps:
        return f"has reached --max-steps {cfg.max_steps}"
    if epoch >= cfg.epochs:
        return f"is at the end of --epochs {cfg.epochs}"
    return None


def restore(
    cfg: TrainConfig,
    world: World,
    model: Any,
    optimizer: Any,
    scaler: Any = None,
    samples: int | None = None,
) -> Position:
    """Load --resume's checkpoint on every rank; returns where training continues. samples:
    this run's training samples, checked against the checkpoint's (hpcdl.resume_changes).

    Everything that can be wrong with the file (a missing attribute, another model's or another
    optimizer's state, a vector of the wrong length, a garbage RNG state, a flag changed that
    breaks the epoch in progress) is found while loading it into the model on each rank, and
    agreed: one line naming the file, every rank stops. Allowed changes are said in one line."""
    path = find_resume_checkpoint(cfg)
    ckpt, error, changed = None, None, None
    if path is not None:
        try:
            ckpt = checkpoint.load(path)
            checkpoint.check_compatible(
                ckpt, path, model.name, shapes(model), buffer_values=int(model.buffers.size)
            )
            if not finished(cfg, ckpt.epoch, ckpt.global_step):  # else: nothing is read
                changed = changes_line(ckpt, path, cfg, samples)
            _load_state(ckpt, path, cfg, world, model, optimizer)
            order = _epoch_order(ckpt, path, world)
            if scaler is not None and ckpt.loss_scale is not None:
                _load_loss_scale(scaler, ckpt, path)
        except checkpoint.CheckpointError as exc:
            error = str(exc)
    agree_on_errors(world.comm, world.rank, error)
    if changed and world.is_root and not cfg.quiet:
        print(changed, flush=True)
    if ckpt is None or not ckpt.run_id:  # afresh, or a checkpoint written before run ids
        run_id = world.comm.bcast(uuid.uuid4().hex[:16] if world.is_root else None, root=0)
    else:
        run_id = ckpt.run_id
    if ckpt is None:
        return Position(run_id=run_id)
    sums = _epoch_sums(ckpt, world)
    return Position(ckpt.epoch, ckpt.step_in_epoch, ckpt.global_step, order, sums, run_id)


def _epoch_sums(ckpt: checkpoint.Checkpoint, world: World) -> tuple[float, ...]:
    """This rank's sums of the checkpoint's epoch so far: its own row when the world size is the
    same; with another, rank 0 holds every rank's total (the epoch's figures sum over ranks)."""
    rows = ckpt.epoch_sums
    if not rows:
        return ()
    if ckpt.world_size == world.size:
        return tuple(rows[world.rank])
    if world.rank != 0:
        return ()
    return tuple(sum(column) for column in zip(*rows, strict=True))


def _epoch_order(ckpt: checkpoint.Checkpoint, path: Path, world: World) -> EpochOrder:
    """How the checkpoint's epoch was being read; CheckpointError if that is unreadable."""
    if ckpt.epoch_order is not None:
        try:
            return EpochOrder.from_json(ckpt.epoch_order)
        except (KeyError, TypeError, ValueError) as exc:
            raise checkpoint.CheckpointError(
                f"checkpoint {path} has an unreadable epoch order ({exc!r}); {checkpoint.DAMAGED}"
            ) from None
    # Written before orders were recorded: its job read one DistributedSampler per rank, placed
    # as here when the world size is the same (the placement was not recorded).
    batch = int(ckpt.config.get("batch_size", 1))
    layout = world.ranks_by_node if ckpt.world_size == world.size else ()
    done = ckpt.step_in_epoch * ckpt.world_size * batch
    return EpochOrder(ckpt.world_size, batch, layout, done)


def continue_epoch(
    cfg: TrainConfig, world: World, spec: SamplerSpec, start: Position
) -> tuple[TrainConfig, Position, RestOfEpoch | None, str | None]:
    """How a resumed run goes on with this job's world size: (configuration, start position,
    the rest of the checkpoint's epoch to read first or None, a line to say or None).

    Another world size keeps the checkpoint's global batch (per-rank batch = global / ranks,
    or the largest below, hpcdl.data.epoch_order.resume_batch) and the learning rate; a
    checkpoint taken mid-epoch by another world size or batch finishes that epoch with every
    sample it had not read exactly once (NOTE [the rest of an epoch])."""
    order = start.order
    if order is None:
        return cfg, start, None, None
    batch = cfg.batch_size
    if order.world_size != world.size:
        batch = resume_batch(order.global_batch, world.size)
        cfg = replace(cfg, batch_size=batch, base_batch=cfg.base_batch or cfg.batch_size)
    same_layout = cfg.shuffle != "node" or order.ranks_by_node == world.ranks_by_node
    if (order.world_size, order.batch_size) == (world.size, batch) and same_layout:
        return cfg, start, None, None
    was = f"{order.world_size} ranks x {order.batch_size} (global batch {order.global_batch})"
    now = f"{world.size} ranks x {batch} (global batch {world.size * batch})"
    line = f"hpcdl: the checkpoint was written by {was}; this job trains on {now}"
    if order.global_batch % world.size and order.world_size != world.size:
        line += f": {order.global_batch} is not a multiple of {world.size} ranks, lr unchanged"
    if not order.samples_done:
        return cfg, start, None, line
    rest = RestOfEpoch(
        start.epoch,
        rest_of_epoch(spec, order, start.epoch, world.rank, world.size, batch),
        order,
    )
    left = rest_size(spec.num_samples, order)
    skipped = left - len(rest.batches) * world.size * batch
    line += f"; the {left} samples left of epoch {start.epoch + 1} are read once each"
    if skipped:
        line += f" but the last {skipped} (less than one global batch), which are skipped"
    return cfg, replace(start, step_in_epoch=0), rest, line


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


def _load_loss_scale(scaler: Any, ckpt: checkpoint.Checkpoint, path: Path) -> None:
    """fp16's loss scale carries over; a checkpoint without one (fp32, bf16) starts afresh."""
    try:
        scaler.load_state_dict(ckpt.loss_scale)
    except (TypeError, ValueError, KeyError) as exc:
        raise checkpoint.CheckpointError(
            f"checkpoint {path} has an unusable loss scale ({exc}); {checkpoint.DAMAGED}"
        ) from None


@diag.spanned(diag.Kind.CHECKPOINT)
def save(run: Run, at: Position, epoch_stats: Any = None) -> Path | None:
    """Collective: gather every rank's RNG state and, mid-epoch, its sums of the epoch so far
    (epoch_stats, a hpcdl.metrics.RunningMean); rank 0 writes the checkpoint of the run's model
    and optimizer (either engine's: hpcdl.engine.Checkpointable), to continue at `at`.
    Returns its path on every rank."""
    cfg, world, model, optimizer = run.cfg, run.world, run.engine.model, run.engine.optimizer
    scaler = run.engine.scaler
    sums = None
    if at.step_in_epoch and epoch_stats is not None:
        stats = epoch_stats
        sums = [stats.steps, stats.samples, float(stats.loss_sum), int(stats.correct)]
    gathered = world.comm.gather((model.get_rng_state(), sums), root=0)
    path = None
    if world.is_root:
        rng_states = [rng for rng, _ in gathered]
        epoch_sums = [row for _, row in gathered] if sums is not None else None
        state = {k: to_host(v) for k, v in optimizer.state_dict().items()}
        ckpt = checkpoint.Checkpoint(
            model=model.name,
            layout=shapes(model),
            params=to_host(model.params).copy(),
            buffers=to_host(model.buffers).copy(),
            optimizer=state,
            epoch=at.epoch,
            step_in_epoch=at.step_in_epoch,
            global_step=at.global_step,
            rng_states=rng_states,
            config=json.loads(cfg.to_json()),
            world_size=world.size,
            loss_scale=scaler.state_dict() if scaler else None,
            epoch_order=run.epoch_order(at).to_json(),
            epoch_sums=epoch_sums,
            run_id=run.start.run_id,
            data_samples=len(run.train_ds),
        )
        path = checkpoint.save(cfg.checkpoint_dir, ckpt)
    return world.comm.bcast(path, root=0)


def shapes(model: Any) -> list[tuple[str, tuple[int, ...]]]:
    return [(name, tuple(shape)) for name, shape, _ in model.layout()]


def _xp(array: Any):
    from hpcdl.backend import array_module  # noqa: PLC0415

    return array_module(array)
