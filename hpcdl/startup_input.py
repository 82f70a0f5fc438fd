"""The input side of a run: where the rank's loader workers run, the node's stager session,
the loaders, and the start line about them (hpcdl.startup builds the rest of a Run; hpcdl.torch's
Loader starts the same input for a PyTorch script)."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

from hpcdl.comm import failure
from hpcdl.comm.failure import agree_on_errors
from hpcdl.comm.world import World
from hpcdl.config import TrainConfig
from hpcdl.data.dataset import DataError
from hpcdl.data.sampler import SamplerSpec
from hpcdl.data.worker_cores import WorkerCores, for_rank
from hpcdl.run import own


def open_input(
    cfg: TrainConfig,
    world: World,
    stack: ExitStack,
    datasets: tuple[Any, Any],
    spec: SamplerSpec,
    first_epoch: int,
    xp: Any = None,
) -> tuple[Any, Any, Any]:
    """(staging session or None, training loader, validation loader or None), owned by the
    run: the workers' cores placed first (mpirun's one-core binding must not confine them),
    then the node's stager, then the loaders. datasets: (training, validation or None).
    Collective."""
    cores = for_rank(world.node_comm, world.local_rank)  # collective on the node
    staging = start_staging(cfg, world, stack, datasets[0], spec, first_epoch, cores)
    loader, val_loader = open_loaders(cfg, world, stack, *datasets, staging, xp, cores)
    return staging, loader, val_loader


def start_staging(
    cfg: TrainConfig,
    world: World,
    stack: ExitStack,
    train_ds: Any,
    spec: SamplerSpec,
    first_epoch: int,
    cores: WorkerCores,
) -> Any:
    """The node's stager session with --stage-dir (None without): owned by the run, and
    abandoned from the failure-notice thread when another rank fails. cores: this rank's
    (hpcdl.data.worker_cores); local rank 0 starts the stager, where its workers run."""
    if not cfg.stage_dir:
        return None
    from hpcdl.staging import StageOptions, StagingSession  # noqa: PLC0415

    options = StageOptions(
        cfg.stage_dir,
        threads=cfg.stage_threads,
        nice=cfg.stage_nice,
        capacity=cfg.stage_capacity,
        keep=cfg.keep_staged,
        verify=cfg.stage_verify,
        protect={"--data": cfg.data, "--val-data": cfg.val_data},
        peers=cfg.peer_staging,
        ranges=cfg.peer_ranges,
        cores=cores.cores,
    )
    staging = StagingSession.start(
        world, train_ds, spec, cfg.batch_size, (first_epoch, cfg.epochs), options
    )
    own(stack, staging.close, staging.abandon)
    stack.enter_context(failure.cleanup_on_stand_down(staging.abandon))
    return staging


def open_loaders(
    cfg: TrainConfig,
    world: World,
    stack: ExitStack,
    train_ds: Any,
    val_ds: Any,
    staging: Any,
    xp: Any,
    cores: WorkerCores,
) -> tuple[Any, Any]:
    """(training loader, validation loader or None), owned by the run. xp: the array module
    that --decode gpu decodes onto (None: NumPy). cores: where the workers run, and what
    --workers defaults to (hpcdl.data.worker_cores NOTE [worker cores])."""
    from hpcdl.data import Loader  # noqa: PLC0415

    workers = cores.default_workers if cfg.workers is None else cfg.workers
    loader, error = None, None
    try:
        loader = Loader(
            train_ds,
            cfg.batch_size,
            workers=workers,
            prefetch=None if cfg.prefetch == "auto" else int(cfg.prefetch),
            seed=cfg.seed,
            augment=cfg.augment,
            locate=staging.locator() if staging else None,
            skip_bad_samples=cfg.skip_bad_samples,
            timeout_s=cfg.loader_timeout,
            ranks_per_node=world.local_size,
            decode=cfg.decode,
            cores=cores,
            **({} if xp is None else {"xp": xp}),
        )
        own(stack, loader.close, loader.close)
    except DataError as exc:  # /dev/shm too small for the batch slots: one line, not one per rank
        error = str(exc)
    agree_on_errors(world.comm, world.rank, error)
    val_loader = None
    if val_ds is not None:
        # the same --augment: validation takes its centre crops (torchvision's), so shapes agree
        val_loader = Loader(val_ds, cfg.batch_size, workers=0, seed=cfg.seed, augment=cfg.augment)
        own(stack, val_loader.close, val_loader.close)
    return loader, val_loader


def loader_line(loader: Any) -> str:
    """The start line about the loader: workers and batch slots per rank, with a warning where
    the slots leave workers idle (hpcdl.data.loader NOTE [default slots])."""
    from hpcdl.data.loader import slot_warning  # noqa: PLC0415

    if loader.workers == 0:
        return "hpcdl: loader: batches built in the training process (--workers 0)"
    how = "auto" if loader.slots_default else "--prefetch"
    line = f"hpcdl: loader: {loader.workers} worker(s) per rank, {loader.slots} batch slots ({how})"
    if loader.decode == "gpu":
        line += f", files decoded in the rank ({loader.decoder_name})"
    placed = loader.cores.describe() if loader.cores is not None else ""
    line += f"; rank 0's {placed}" if placed else ""
    warning = slot_warning(loader.workers, loader.slots)
    return line + (f"; warning: {warning}" if warning else "")
