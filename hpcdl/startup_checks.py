"""The start-up's agreements before anything is built: the outputs can be written, the stage
dir is allowed, a rank's share of the data holds a batch, and every rank runs the same model
and configuration. Each is checked where it can be (rank 0 for the outputs, every rank for the
rest) and ends every rank with one line.

--workers is bounded by the node: WORKERS_PER_CORE loader processes per core the job has there,
shared by the node's ranks (a worker blocked in a read leaves its core to another, so a few per
core can pay; thousands only thrash, and --workers 100000 kept starting processes for minutes).

--checkpoint-dir is rank 0's (the only writer): probed by creating it as checkpoint.save would
and a file in it, both removed again, so a directory that cannot take checkpoints stops the run
before it trains and a start-up that stops later leaves nothing. A fresh run (--resume none)
into one that holds checkpoints is refused: its checkpoints would replace the earlier run's of
the same names."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from hpcdl import checkpoint, run_outputs
from hpcdl.atomic import reason
from hpcdl.comm.failure import SystemExitWithMessage, agree_on_errors
from hpcdl.comm.world import World
from hpcdl.config import TrainConfig
from hpcdl.data.worker_cores import job_cores
from hpcdl.paths import nearest_existing

WORKERS_PER_CORE = 4  # the most loader workers per core of the node, all its ranks' together


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


def check_settings(cfg: TrainConfig, world: World) -> None:
    """The run's outputs, --stage-dir and --workers checked on every rank, each error said
    once, before the start line; collective."""
    check_outputs(cfg, world)
    check_stage_dir(cfg, world)
    check_workers(cfg, world)


def check_outputs(cfg: TrainConfig, world: World) -> None:
    """--metrics must be a file rank 0 can create or append to, --checkpoint-dir a directory it
    can write checkpoints into, empty of checkpoints unless the run resumes.

    Checked on rank 0 (the only writer), leaving nothing behind (module notes); every rank
    stops on an error, rank 0 prints it."""
    error = world.comm.bcast(_output_error(cfg) if world.is_root else None, root=0)
    if error:
        raise SystemExitWithMessage(error if world.is_root else None)


def batch_size_error(batch_size: int, samples: int, ranks: int, data: str) -> str | None:
    """The error when each of `ranks` ranks gets fewer than `batch_size` of the data set's
    `samples` (not one step an epoch), else None; hpcdl.stage's dry run says the same."""
    per_rank = samples // ranks
    if batch_size <= per_rank:
        return None
    if 0 < samples < ranks:  # no batch size helps: fewer ranks do
        most = samples // batch_size
        fix = f"{most} rank(s)" if most else f"{samples} rank(s) and --batch-size 1"
        return (
            f"{data} has fewer samples ({samples}) than ranks ({ranks}), and every rank needs a "
            f"batch of its own; use at most {fix}"
        )
    return (
        f"--batch-size {batch_size} is larger than each rank's shard of {data} "
        f"({samples} samples / {ranks} ranks = {per_rank}); "
        f"use a batch size <= {per_rank} or fewer ranks"
    )


def check_workers(cfg: TrainConfig, world: World) -> None:
    """--workers beyond the node's bound (module notes): every rank stops, before a worker
    starts, with one line."""
    error = None
    if cfg.workers is not None:
        error = workers_error(cfg.workers, world.local_size, len(job_cores()))
    agree_on_errors(world.comm, world.rank, error)


def workers_error(workers: int, ranks_on_node: int, cores: int) -> str | None:
    """The error when `workers` loader workers for each of `ranks_on_node` ranks exceed
    WORKERS_PER_CORE per core of the node's `cores` (at least 1 per rank is always fine)."""
    most = max(1, WORKERS_PER_CORE * cores // max(1, ranks_on_node))
    if workers <= most:
        return None
    return (
        f"--workers {workers} is more loader workers than this node can run: at most "
        f"{WORKERS_PER_CORE} per core of its {cores} core(s), shared by {ranks_on_node} rank(s), "
        f"is {most} per rank; give --workers {most} or fewer, or leave it out for a fair share"
    )


def check_stage_dir(cfg: TrainConfig, world: World) -> None:
    """--stage-dir that overlaps the data or is a file: refused on every rank, said once,
    before anything is created (the stager session checks again, with what it creates)."""
    if not cfg.stage_dir:
        return
    from hpcdl.staging import ownership  # noqa: PLC0415

    error = None
    try:
        ownership.check_stage_dir(cfg.stage_dir, {"--data": cfg.data, "--val-data": cfg.val_data})
    except ownership.StageDirError as exc:
        error = str(exc)
    agree_on_errors(world.comm, world.rank, error)


def _output_error(cfg: TrainConfig) -> str | None:
    inside = run_outputs.inside_data_error(cfg)  # NOTE [a run's outputs]
    if inside:
        return inside
    if cfg.metrics:
        metrics = Path(cfg.metrics)
        if metrics.is_dir():
            return (
                f"--metrics {metrics} is a directory; give a file name such as "
                f"{metrics / 'metrics.jsonl'}"
            )
        parent = nearest_existing(metrics.parent)
        if not parent.is_dir():
            return f"--metrics {metrics} cannot be created: {parent} is not a directory"
        target = metrics if metrics.exists() else parent
        if not os.access(target, os.W_OK):
            return f"--metrics {metrics} cannot be written: no write permission on {target}"
    if cfg.checkpoint_dir:
        return _checkpoint_dir_error(Path(cfg.checkpoint_dir), cfg.resume)
    return None


def _checkpoint_dir_error(ckpt_dir: Path, resume: str) -> str | None:
    if ckpt_dir.exists() and not ckpt_dir.is_dir():
        return f"--checkpoint-dir {ckpt_dir} is a file; give a directory (created if missing)"
    newest = checkpoint.latest(ckpt_dir)
    if newest is not None and resume == "none":
        model = checkpoint.recorded(newest, "model")
        what = f"model '{model}'" if model else "not readable as a checkpoint"
        return (
            f"--checkpoint-dir {ckpt_dir} holds checkpoints of an earlier run (newest "
            f"{newest.name}, {what}); add --resume auto to continue it, or give an empty "
            "--checkpoint-dir to start over"
        )
    missing = not ckpt_dir.exists()
    failed = _probe(ckpt_dir)
    if failed is None:
        return None
    return (
        f"--checkpoint-dir {ckpt_dir} cannot be {'created' if missing else 'written'}: "
        f"{reason(failed)}; {checkpoint.what_to_do(failed, ckpt_dir)}"
    )


def _probe(directory: Path) -> OSError | None:
    """Create directory as checkpoint.save would and a file in it, then remove the file and the
    directories it made (save makes them again), so a start-up that stops later leaves nothing;
    the OSError of the first step that failed, or None."""
    made = [d for d in (directory, *directory.parents) if not d.exists()]  # deepest first
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".hpcdl-probe.", suffix=".tmp")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return exc
    finally:
        for d in made:
            try:
                d.rmdir()  # only an empty directory: never anything another process put there
            except OSError:
                pass
    return None
