"""Start-up of a training run: build the Run (hpcdl.run) whose ExitStack owns every resource.

Each step does purely local checks first and then agrees collectively (agree_on_errors), so a
problem seen by one rank stops every rank, and a problem seen by all is printed once. Each
resource goes on the run's stack as soon as it exists (NOTE [closing a run] in hpcdl/run.py), so
a start-up that fails half way closes what it had made.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from hpcdl import backend, diag, messages
from hpcdl.comm import blas_threads, cuda_aware, ulfm
from hpcdl.comm.failure import StopAgreement, agree_on_errors
from hpcdl.comm.node_watch import NodeWatch
from hpcdl.comm.world import World
from hpcdl.config import TrainConfig
from hpcdl.data.dataset import index_record
from hpcdl.data.sampler import SamplerSpec
from hpcdl.engine import Engine
from hpcdl.engines import build_engine
from hpcdl.metrics import MetricsError, MetricsWriter, Progress
from hpcdl.resume import continue_epoch, restore, stop_if_finished
from hpcdl.run import Run, own
from hpcdl.run_outputs import hold_checkpoint_dir
from hpcdl.startup_checks import batch_size_error, check_settings
from hpcdl.startup_input import loader_line, open_input


def env_rank() -> int:
    """This process's world rank as announced by the launcher (0 for a singleton)."""
    return messages.launcher_rank()


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

    Rank 0 opens them, building an image folder's index or mapping it from its cache, and
    tells the other ranks where the index file is: they map the same file, so a node holds its
    pages once (NOTE [the index] in hpcdl/data/imagefolder.py). A node that cannot see that
    file gets its bytes from rank 0 and caches them on the node (share_index). Other data sets
    (HDF5) are opened on every rank. The validation labels are remapped onto the training
    classes by name (align_classes)."""
    from hpcdl.data import open_dataset  # noqa: PLC0415
    from hpcdl.data.dataset import align_classes  # noqa: PLC0415

    paths = [cfg.data, *([cfg.val_data] if cfg.val_data else [])]
    shared = None
    opened: list[Any] = [None] * len(paths)
    if world.is_root:
        found, error = _local_error(
            lambda: [open_dataset(p, cfg.index_in_data_root) for p in paths]
        )
        opened = found or opened
        refs = [_index_ref(d) for d in found or []]
        shared = (error, refs)
    error, refs = world.comm.bcast(shared, root=0)

    def receive(path: str, ref: tuple | None) -> Any:
        from hpcdl.data.kinds import from_index_file  # noqa: PLC0415

        if ref is None:
            return open_dataset(path)
        return None if ref[0] is None else from_index_file(path, *ref)

    if not world.is_root and error is None:
        found, error = _local_error(lambda: [receive(*pr) for pr in zip(paths, refs)])
        opened = found or opened
    if world.comm.bcast(error is None if world.is_root else None, root=0):
        for i, ref in enumerate(refs):  # collective: every rank, whatever its own error
            if ref is not None:
                args = (world, opened[i], paths[i], ref[1], cfg.index_in_data_root)
                opened[i], failed = _local_error(lambda: share_index(*args))  # noqa: B023
                error = error or failed
    train_ds, val_ds = (opened + [None])[:2] if error is None else (None, None)
    if error is None:
        error = _class_error(cfg, train_ds, val_ds)
    if error is None:
        error = batch_size_error(cfg.batch_size, len(train_ds), world.size, cfg.data)
    if error is None and val_ds is not None:
        error = _shape_error(cfg, train_ds, val_ds)
    if error is None and val_ds is not None:
        _, error = _local_error(lambda: align_classes(val_ds, train_ds))
    agree_on_errors(world.comm, world.rank, error)  # also: every node's cache is written
    for ds in (train_ds, val_ds) if world.is_root and not cfg.quiet else ():
        if ds is not None and ds.kind == "tar":  # a start line: where the classes came from
            print(ds.describe(), flush=True)
    return train_ds, val_ds


def _class_error(cfg: TrainConfig, train_ds: Any, val_ds: Any) -> str | None:
    """Labels that tar shards' classes.json does not name (the index knows every label), or a
    training set of one class: said before the model is built, not at a sample or by the
    model's num_classes check."""
    for flag, ds in (("--data", train_ds), ("--val-data", val_ds)):
        if ds is not None and ds.kind == "tar":
            _, error = _local_error(ds.check_classes)
            if error is not None:
                return f"{flag}: {error}"
    if train_ds.num_classes >= 2:
        return None
    held = f"one class, {train_ds.classes[0]!r}" if train_ds.num_classes == 1 else "no class"
    origin = getattr(train_ds, "classes_from", "")  # tar shards: classes.json or the labels
    fix = f"; list every class in {origin}" if origin.endswith(".json") else ""
    return (
        f"--data {cfg.data} holds {held}{f' (from {origin})' if origin else ''}: a classifier "
        f"needs at least 2 classes{fix}"
    )


def _index_ref(ds: Any) -> tuple[Path | None, str] | None:
    """(where rank 0's index file is, its key) of an image folder or tar shards; None for
    other kinds."""
    return (ds.index_path, ds.index.meta["key"]) if ds.kind in ("folder", "tar") else None


def share_index(world: World, ds: Any, root: str, key: str, in_data_root: bool) -> Any:
    """ds, or (where it is None: rank 0's index file is not visible here) the image folder
    built from rank 0's index, which the node's first rank writes to the node's cache for
    every rank and loader worker of the node to map. Collective; the bytes go over MPI only
    when some rank lacks them."""
    from hpcdl.data.kinds import dataset_of_index, save_shared_index  # noqa: PLC0415

    if not any(world.comm.allgather(ds is None)):
        return ds
    data = world.comm.bcast(ds.index.to_bytes() if world.is_root else None, root=0)
    path = None
    if any(world.node_comm.allgather(ds is None)):
        if world.local_rank == 0:
            if ds is None:
                path = save_shared_index(root, data, in_data_root)
            else:
                path = ds.index_path
        path = world.node_comm.bcast(path, root=0)
    if ds is not None:
        return ds
    return dataset_of_index(root, data, path, key)


def input_shape(cfg: TrainConfig, ds: Any) -> tuple[int, int, int]:
    """(C, H, W) of the samples the loaders yield for ds under --augment: the model's input."""
    from hpcdl.data.augment import parse_augment  # noqa: PLC0415
    from hpcdl.data.batch import output_shape  # noqa: PLC0415

    return output_shape(ds, parse_augment(cfg.augment))


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


def sampler_spec(cfg: TrainConfig, world: World, num_samples: int) -> SamplerSpec:
    """The job's reading order: every rank's sampler, and the staging plan, come from it."""
    return SamplerSpec(
        num_samples=num_samples,
        world_size=world.size,
        seed=cfg.seed,
        shuffle=cfg.shuffle,
        ranks_by_node=world.ranks_by_node,
    )


def start_run(cfg: TrainConfig, world: World) -> Run:
    """Everything this rank needs to train, agreed with the other ranks; collective.

    Use as `with start_run(cfg, world) as run:`; leaving the block closes it all."""
    say = Progress(cfg.epochs, 0, enabled=world.is_root and not cfg.quiet).say
    with ExitStack() as stack:
        xp, error = backend.try_select(cfg.device, world.local_rank)
        agree_on_errors(world.comm, world.rank, error)  # no GPU: one message, every rank stops
        check_settings(cfg, world)  # config errors: said before the start line, every rank
        hold_checkpoint_dir(cfg, world, stack)  # one run at a time (NOTE [a run's outputs])
        aware = cuda_aware.detect(world.comm, cfg.device)
        host_staged = cfg.device == "gpu" and not aware.aware
        say(start_line(cfg, world, aware))
        warn_if_not_fault_tolerant(cfg, world)
        # a lost node is named, in one line (comm.node_watch); lost ranks may be MPI's to handle
        watch = NodeWatch(world, closed_is_lost=cfg.on_node_loss == "stop")
        own(stack, watch.close, watch.abandon)
        diagnostics = start_diagnostics(cfg, world, stack)  # timeline, stalls, flight recorder
        train_ds, val_ds = open_datasets(cfg, world)
        spec = sampler_spec(cfg, world, len(train_ds))
        sampler = spec.for_rank(world.rank)
        engine = build_engine(cfg, world, stack, input_shape(cfg, train_ds),
                              train_ds.num_classes, xp, host_staged)  # fmt: skip
        state = (engine.model, engine.optimizer, engine.scaler)
        cfg, start, rest = resume_point(cfg, world, spec, state, say)
        staging, loader, val_loader = open_input(cfg, world, stack, (train_ds, val_ds), spec,
                                                 start.epoch, xp)  # fmt: skip
        if staging and world.is_node_leader:  # --timeline: the node's stager as rates
            diagnostics.add_counters("stager", staging.counter_sample)
        say(loader_line(loader))
        say_settings(cfg, engine, say)
        stop = StopAgreement(world.comm)
        own(stack, stop.close, stop.abandon)
        threads = set_cpu_threads(world, say)  # after every start-up check: said once ready
        steps_per_epoch = sampler.steps_per_epoch(cfg.batch_size)
        metrics = open_metrics(cfg, world, stack, (aware.aware, engine.kind), threads,
                               steps_per_epoch)  # fmt: skip
        metrics.write("index", **index_record(train_ds, val_ds))  # image folders: index seconds
        shown = world.is_root and not cfg.quiet  # --quiet: no progress whatever --progress says
        return Run(
            cfg=cfg,
            world=world,
            xp=xp,
            cuda_aware=aware.aware,
            host_staged=host_staged,
            train_ds=train_ds,
            val_ds=val_ds,
            sampler=sampler,
            engine=engine,
            schedule=lr_schedule(cfg, world, steps_per_epoch),
            start=start,
            rest=rest,
            loader=loader,
            val_loader=val_loader,
            staging=staging,
            stop=stop,
            metrics=metrics,
            progress=Progress(cfg.epochs, steps_per_epoch, enabled=shown, mode=cfg.progress),
            stack=stack.pop_all(),
        )


def resume_point(
    cfg: TrainConfig, world: World, spec: SamplerSpec, state: tuple[Any, Any, Any], say: Any
) -> tuple[TrainConfig, Any, Any]:
    """Where training starts: (cfg, start, rest) after the --resume checkpoint, if any, is
    loaded into state (model, optimizer, loss scaler) and its epoch carried over to this
    world (hpcdl.resume). A finished chain's last job ends here (one line, exit 0)."""
    start = restore(cfg, world, *state, samples=spec.num_samples)
    stop_if_finished(cfg, start)  # a chain's last job: one line, exit 0 (hpcdl.train)
    if start.global_step:
        say(f"hpcdl: resumed at epoch {start.epoch + 1}, step {start.step_in_epoch} ({cfg.resume})")
    cfg, start, rest, reshaped = continue_epoch(cfg, world, spec, start)  # another world
    if reshaped:
        say(reshaped)
    return cfg, start, rest


def start_line(cfg: TrainConfig, world: World, aware: Any) -> str:
    """The run's first line: ranks, nodes, device, and the CUDA-awareness answer (why)."""
    return (
        f"hpcdl: {world.size} rank(s) on {world.num_nodes} node(s), device {cfg.device}, "
        f"CUDA-aware MPI: {'yes' if aware.aware else 'no'} ({aware.reason})"
    )


def warn_if_not_fault_tolerant(cfg: TrainConfig, world: World) -> None:
    """--on-node-loss continue where MPI cannot survive a lost rank: one line on rank 0, also
    with --quiet (hpcdl.comm.ulfm.not_fault_tolerant_line)."""
    line = ulfm.not_fault_tolerant_line(os.environ, world.size)
    if cfg.on_node_loss == "continue" and line and world.is_root:
        print(line, file=sys.stderr, flush=True)


def say_settings(cfg: TrainConfig, engine: Engine, say: Any) -> None:
    """The start-up lines for settings a user should see: the precision, an --lr of 0, a
    --tf32 that changes nothing here."""
    if cfg.precision != "fp32":
        say(engine.precision_line)
    if cfg.lr == 0:
        say("hpcdl: --lr 0: the parameters will not change")
    if cfg.tf32 and (line := engine.tf32_line):
        say(line)


def start_diagnostics(cfg: TrainConfig, world: World, stack: ExitStack) -> diag.DiagSession:
    """The run's hpcdl.diag session, owned by stack. Flight records go to the run's directory:
    --checkpoint-dir, else beside --metrics, else beside --timeline; a run with none of them
    writes none (it has no directory of its own)."""
    outputs = [cfg.checkpoint_dir, cfg.metrics and Path(cfg.metrics).parent, cfg.timeline and
               Path(cfg.timeline).parent]  # fmt: skip
    options = diag.DiagOptions(
        stall_warning=cfg.stall_warning,
        stall_shutdown=cfg.stall_shutdown,
        timeline=cfg.timeline,
        run_dir=next((str(o) for o in outputs if o), None),
        quiet=cfg.quiet,
    )
    session = diag.DiagSession.open(world.comm, world.node_comm, options, world.node_index)
    own(stack, session.close, session.abandon)
    return session


def open_metrics(
    cfg: TrainConfig,
    world: World,
    stack: ExitStack,
    aware_and_engine: tuple[bool, str],
    threads: list[int],
    steps_per_epoch: int,
) -> MetricsWriter:
    """The run's metrics (JSONL and --tensorboard, rank 0), owned by stack, with its `start`
    record written: whether MPI is CUDA-aware, and which engine runs the model."""
    cuda_aware_mpi, engine = aware_and_engine
    metrics = MetricsWriter(
        cfg.metrics if world.is_root else None, tensorboard=tensorboard_events(cfg, world)
    )
    own(stack, metrics.close, metrics.close)
    metrics.write(
        "start",
        world_size=world.size,
        global_batch=cfg.batch_size * world.size,
        model=cfg.model,
        engine=engine,
        device=cfg.device,
        cuda_aware=cuda_aware_mpi,
        cpu_threads=threads,
        sync=cfg.sync,
        steps_per_epoch=steps_per_epoch,
        config=cfg.to_json(),
    )
    return metrics


def set_cpu_threads(world: World, say: Any) -> list[int]:
    """Set every rank's compute threads from where it runs (hpcdl.comm.blas_threads); rank 0
    says the choice once. Collective. Returns the threads of every rank, by rank."""
    choice, pool = blas_threads.set_for_rank(world.node_comm)
    by_rank = world.comm.allgather(choice.threads)
    say(blas_threads.describe(choice, pool, by_rank))
    return by_rank


def tensorboard_events(cfg: TrainConfig, world: World) -> Any:
    """--tensorboard's event writer on rank 0 (hpcdl.tensorboard_events), else None."""
    if not (cfg.tensorboard and world.is_root):
        return None
    from hpcdl.tensorboard_events import TensorBoardEvents  # noqa: PLC0415

    try:
        return TensorBoardEvents(cfg.tensorboard)
    except OSError as exc:
        raise MetricsError(
            f"cannot write --tensorboard {cfg.tensorboard}: {exc.strerror or exc}; give a "
            "writable directory"
        ) from None


def lr_schedule(cfg: TrainConfig, world: World, steps_per_epoch: int) -> Any:
    """--lr (linearly scaled to the global batch with --lr-scaling linear) over the run."""
    from hpcdl import nn  # noqa: PLC0415

    lr = cfg.lr
    if cfg.lr_scaling == "linear":
        lr = nn.schedule.scaled_lr(
            cfg.lr, cfg.batch_size * world.size, cfg.base_batch or cfg.batch_size
        )
    return nn.schedule.LrSchedule(lr, steps_per_epoch, cfg.warmup_epochs, cfg.lr_decay, cfg.epochs)
