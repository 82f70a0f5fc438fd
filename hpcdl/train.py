"""`mpirun -np N python -m hpcdl.train ...`: data-parallel training, one MPI rank per GPU.

Read top to bottom: configuration, MPI and device, data, model, loop, evaluation, checkpoint.
Every rank runs this file; rank 0 prints and writes metrics. Gradients are averaged with a
bucketed allreduce that overlaps with backward (hpcdl.comm.reducer).
"""

from __future__ import annotations

import math
import sys
import time

import numpy as np

from hpcdl import backend, startup
from hpcdl.comm import collectives, cuda_aware
from hpcdl.comm.failure import (
    StopAgreement,
    SystemExitWithMessage,
    UserError,
    agree_on_errors,
    install_abort_on_exception,
)
from hpcdl.comm.reducer import GradientReducer
from hpcdl.comm.world import World, init_world
from hpcdl.config import ConfigError, TrainConfig, parse_args
from hpcdl.data.dataset import DataError, index_record
from hpcdl.data.device import on_device
from hpcdl.data.pool import LoaderFault, LoaderTimeout
from hpcdl.data.sampler import eval_indices
from hpcdl.metrics import MetricsWriter, Progress, RunningMean, StepTimes

EXIT_STOPPED_BY_SIGNAL = 3
EXIT_LOADER_TIMEOUT = 4  # a loader worker stayed silent past --loader-timeout
EXIT_DATA_ERROR = 1  # a sample or file that cannot be read mid-run
EXIT_LOADER_FAULT = 2  # a loader worker died


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse_args(argv)
    except ConfigError as exc:
        return startup.fail_once(f"hpcdl.train: error: {exc}")
    world = init_world()
    install_abort_on_exception(world.comm, world.rank)
    try:
        return train(cfg, world)
    except SystemExitWithMessage as exc:
        return startup.fail_once(exc.message and f"hpcdl.train: error: {exc.message}", world.comm)
    except (DataError, LoaderFault) as exc:  # mid-run: one line from this rank (comm.failure)
        status = EXIT_DATA_ERROR if isinstance(exc, DataError) else EXIT_LOADER_FAULT
        status = EXIT_LOADER_TIMEOUT if isinstance(exc, LoaderTimeout) else status
        raise UserError(str(exc), status) from None


def train(cfg: TrainConfig, world: World) -> int:
    say = Progress(cfg.epochs, 0, enabled=world.is_root and not cfg.quiet).say

    # --- device and MPI capabilities -------------------------------------------------------
    xp, error = backend.try_select(cfg.device, world.local_rank)
    agree_on_errors(world.comm, world.rank, error)  # no GPU: one message, every rank stops
    aware = cuda_aware.detect(world.comm, cfg.device)
    host_staged = cfg.device == "gpu" and not aware.aware
    say(
        f"hpcdl: {world.size} rank(s) on {world.num_nodes} node(s), device {cfg.device}, "
        f"CUDA-aware MPI: {'yes' if aware.aware else 'no'} ({aware.reason})"
    )

    # --- outputs and data ---------------------------------------------------------------------
    startup.check_outputs(cfg, world)  # --metrics, --checkpoint-dir: one message, every rank
    train_ds, val_ds = startup.open_datasets(cfg, world)
    sampler = startup.make_sampler(cfg, world, len(train_ds))
    steps_per_epoch = sampler.steps_per_epoch(cfg.batch_size)
    global_batch = cfg.batch_size * world.size

    # --- model, identical on every rank ------------------------------------------------------
    from hpcdl import nn  # noqa: PLC0415

    model = startup.build_model(cfg, world, train_ds, xp)  # for the shape the loader yields
    model.set_rng_state(nn.rank_rng_state(cfg.seed, world.rank))
    startup.verify_same_run(world, cfg, startup.shapes(model))
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
    # --sync-bn: BatchNorm sums its batch statistics over the ranks (a collective per layer)
    bn_stats = None
    if cfg.sync_bn and world.size > 1:
        bn_stats = collectives.SumReducer(world.comm, host_staged=host_staged)
        model.set_stat_reducer(bn_stats)
    base_batch = cfg.base_batch or cfg.batch_size
    lr = (
        nn.schedule.scaled_lr(cfg.lr, global_batch, base_batch)
        if cfg.lr_scaling == "linear"
        else cfg.lr
    )
    start_epoch, start_step, global_step = startup.restore(cfg, world, model, optimizer)
    if global_step:
        say(f"hpcdl: resumed at epoch {start_epoch + 1}, step {start_step} ({cfg.resume})")

    # --- staging and loaders -----------------------------------------------------------------
    staging = None
    if cfg.stage_dir:
        from hpcdl.staging import StagingSession  # noqa: PLC0415

        sampler_args = dict(
            num_samples=len(train_ds),
            world_size=world.size,
            seed=cfg.seed,
            shuffle=cfg.shuffle,
            ranks_by_node=world.ranks_by_node,
        )
        staging = StagingSession.start(
            world,
            train_ds,
            sampler_args,
            cfg.batch_size,
            (start_epoch, cfg.epochs),
            cfg.stage_dir,
            cfg.stage_threads,
            cfg.stage_capacity,
            cfg.keep_staged,
            cfg.stage_verify,
            protect={"--data": cfg.data, "--val-data": cfg.val_data},
        )
    from hpcdl.data import Loader, default_workers  # noqa: PLC0415

    workers = (
        default_workers(ranks_per_node=world.local_size) if cfg.workers is None else cfg.workers
    )
    loader, error = None, None
    try:
        loader = Loader(
            train_ds,
            cfg.batch_size,
            workers=workers,
            prefetch=cfg.prefetch,
            seed=cfg.seed,
            augment=cfg.augment,
            locate=staging.locator() if staging else None,
            skip_bad_samples=cfg.skip_bad_samples,
            timeout_s=cfg.loader_timeout,
        )
    except DataError as exc:  # /dev/shm too small for the batch slots: one line, not one per rank
        error = str(exc)
    agree_on_errors(world.comm, world.rank, error)
    val_loader = (
        Loader(val_ds, cfg.batch_size, workers=0, seed=cfg.seed, augment=cfg.augment)
        if val_ds
        else None
    )

    reducer = None
    if world.size > 1 and cfg.params_sync_every == 0:
        reducer = GradientReducer(
            world.comm, model.grads, cfg.bucket_mb, host_staged=host_staged, prescaled=True
        )
    stop = StopAgreement(world.comm)
    metrics = MetricsWriter(cfg.metrics if world.is_root else None)
    metrics.write(
        "start",
        world_size=world.size,
        global_batch=global_batch,
        model=cfg.model,
        device=cfg.device,
        cuda_aware=aware.aware,
        sync=cfg.sync,
        steps_per_epoch=steps_per_epoch,
        config=cfg.to_json(),
    )
    metrics.write("index", **index_record(train_ds, val_ds))  # image folders: index seconds
    shown = world.is_root and not cfg.quiet  # --quiet: no progress whatever --progress says
    progress = Progress(cfg.epochs, steps_per_epoch, enabled=shown, mode=cfg.progress)

    # --- training loop -----------------------------------------------------------------------
    run = RunningMean()
    history: dict = {}
    stopped_by, checkpoint_path = None, None
    run_start = time.perf_counter()
    for epoch in range(start_epoch, cfg.epochs):
        progress.start_epoch(epoch)
        epoch_stats = RunningMean()
        epoch_start = time.perf_counter()
        first = start_step if epoch == start_epoch else 0
        batches = sampler.batches(epoch, cfg.batch_size)[first:]
        step = first
        t_wait = time.perf_counter()
        # a stop signal while waiting on a stalled worker: the loader builds the batch itself
        host_batches = loader.iterate(batches, epoch, train=True, stop_requested=stop.requested)
        for images, labels in on_device(host_batches, xp):
            stop.start_step()
            t0 = time.perf_counter()
            times = StepTimes(t_data=t0 - t_wait)

            logits = model.forward(images, train=True)  # images (B, C, H, W) float32 on xp
            loss, dlogits = nn.softmax_cross_entropy(logits, labels)  # labels (B,) int64
            if reducer:
                dlogits *= 1.0 / world.size  # gradients of loss / N: their sum is the average
                reducer.begin_step()
            model.backward(dlogits, grad_ready=reducer.mark_ready if reducer else None)
            backend.synchronize(xp)
            t1 = time.perf_counter()
            if reducer:
                reducer.wait()  # gradients are now averaged over all ranks
            t2 = time.perf_counter()
            step_lr = nn.schedule.lr_at(
                global_step, steps_per_epoch, lr, cfg.warmup_epochs, cfg.lr_decay, cfg.epochs
            )
            optimizer.step(step_lr)
            if cfg.params_sync_every and (global_step + 1) % cfg.params_sync_every == 0:
                collectives.allreduce_mean(world.comm, model.params, host_staged)
            backend.synchronize(xp)
            t3 = time.perf_counter()

            loss = float(loss)
            stop_if_loss_not_finite(world, loss, global_step, epoch)
            times.t_compute, times.t_comm_exposed, times.t_update = t1 - t0, t2 - t1, t3 - t2
            times.t_step = t3 - t_wait
            correct = nn.accuracy_count(logits, labels)
            epoch_stats.add(times, loss, correct, len(labels))
            run.add(times, loss, correct, len(labels))
            step += 1
            global_step += 1
            if staging:
                staging.consumed(epoch, step)
            progress.update(step, epoch_stats.loss, epoch_stats.acc)
            if global_step % cfg.metrics_every == 0:
                metrics.write(
                    "step",
                    step=global_step,
                    epoch=epoch,
                    loss=loss,
                    lr=step_lr,
                    **vars(times),
                    samples_per_s=global_batch / max(times.t_step, 1e-9),
                )
                ahead = staging.progress_record() if staging and world.is_root else None
                if ahead:  # how far staging runs ahead of the readers
                    metrics.write("staging", step=global_step, epoch=epoch, **ahead)

            end_of_epoch = step == steps_per_epoch
            position = (epoch + 1, 0) if end_of_epoch else (epoch, step)
            if stop.should_stop():
                stopped_by = stop.signal_name
                if cfg.checkpoint_dir:
                    checkpoint_path = startup.save(
                        cfg, world, model, optimizer, *position, global_step
                    )
                break
            if (
                cfg.checkpoint_dir
                and cfg.checkpoint_every
                and global_step % cfg.checkpoint_every == 0
                and not end_of_epoch
            ):
                startup.save(cfg, world, model, optimizer, *position, global_step)
            if cfg.max_steps and global_step >= cfg.max_steps:
                break
            t_wait = time.perf_counter()
        if stopped_by:
            break

        # --- end of epoch: evaluate, report, checkpoint --------------------------------------
        collectives.allreduce_mean(world.comm, model.buffers, host_staged)  # BatchNorm stats
        seconds = time.perf_counter() - epoch_start
        history = evaluate(
            world, model, val_loader, len(val_ds) if val_ds else 0, xp, cfg.batch_size, epoch_stats
        )
        values = {k: history[k] for k in ("loss", "acc", "val_loss", "val_acc") if k in history}
        progress.end_epoch(step, values)
        stage_stats = staging.epoch_stats() if staging else None
        metrics.write(
            "epoch",
            epoch=epoch,
            **values,
            seconds=seconds,
            images_per_s=epoch_stats.samples * world.size / max(seconds, 1e-9),
            staging=stage_stats,
            staging_nodes=staging_nodes(world, stage_stats),
        )
        if cfg.checkpoint_dir and step == steps_per_epoch:
            checkpoint_path = startup.save(cfg, world, model, optimizer, epoch + 1, 0, global_step)
        if cfg.max_steps and global_step >= cfg.max_steps:
            break

    # --- summary -----------------------------------------------------------------------------
    elapsed = time.perf_counter() - run_start
    stats = loader.stats()
    bad = sum(world.comm.allgather(stats.get("bad_samples", 0)))  # releases the GIL (failure.py)
    stage_stats = staging.epoch_stats() if staging else None
    metrics.write(
        "summary",
        world_size=world.size,
        global_batch=global_batch,
        epochs=cfg.epochs,
        steps=global_step,
        val_accuracy=history.get("val_acc"),
        val_loss=history.get("val_loss"),
        train_loss=history.get("loss"),
        images_per_s=run.samples * world.size / max(elapsed, 1e-9),
        mean_step=run.mean_parts(),
        cuda_aware=aware.aware,
        sync=cfg.sync,
        staging=stage_stats,
        staging_nodes=staging_nodes(world, stage_stats),
        bad_samples=bad,
        stopped_by_signal=stopped_by is not None,
        checkpoint=str(checkpoint_path) if checkpoint_path else None,
    )
    loader.close()
    if val_loader:
        val_loader.close()
    if reducer:
        reducer.close()
    if bn_stats:
        bn_stats.close()
    stop.close()
    if staging:
        staging.close()
    metrics.close()
    if stopped_by:
        where = (
            f"checkpoint at {checkpoint_path}"
            if checkpoint_path
            else "no checkpoint written (no --checkpoint-dir)"
        )
        if world.is_root:
            print(f"hpcdl.train: stopped by signal {stopped_by}, {where}", flush=True)
        return EXIT_STOPPED_BY_SIGNAL
    if world.is_root:  # also with --quiet: the one line a batch log needs
        print(final_line(history, run.samples * world.size / max(elapsed, 1e-9)), flush=True)
    return 0


def final_line(history: dict[str, float], images_per_s: float) -> str:
    """The run's result: validation accuracy, else the last epoch's training loss and accuracy."""
    rate = f"({images_per_s:.0f} images/s)"
    if "val_acc" in history:
        return f"hpcdl.train: final val_acc {history['val_acc']:.4f} {rate}"
    if "acc" in history:
        return (
            f"hpcdl.train: final train loss {history['loss']:.4f}, "
            f"train acc {history['acc']:.4f} {rate}"
        )
    return "hpcdl.train: nothing to train: the resumed checkpoint is past the last epoch"


def stop_if_loss_not_finite(world: World, loss: float, step: int, epoch: int) -> None:
    """Stop every rank with one message when any rank's loss is NaN or infinite.

    Collective (one 8-byte allreduce per step): with --sync params:K, or a loss that overflows
    without poisoning the gradients, the ranks do not all see it at the same step."""
    flag = np.array([0.0 if math.isfinite(loss) else 1.0])
    collectives.allreduce_sum(world.comm, flag)
    if not flag[0]:
        return
    losses = world.comm.allgather(loss)
    bad = next(r for r, value in enumerate(losses) if not math.isfinite(value))
    raise SystemExitWithMessage(
        f"loss became {losses[bad]} at step {step} (epoch {epoch + 1}) on rank {bad}; "
        "lower --lr or check the input data"
        if world.rank == 0
        else None
    )


def staging_nodes(world: World, stats: dict | None) -> list[dict] | None:
    """Staging figures per node, on rank 0: the node's files and bytes staged, and hits and
    misses summed over its ranks. Collective; None when staging is off."""
    if stats is None:
        return None
    shared = {k: stats[k] for k in ("files_staged", "bytes_staged")}
    return world.per_node(shared, {k: stats[k] for k in ("hits", "misses")})


def evaluate(
    world: World, model, val_loader, val_size: int, xp, batch_size: int, epoch_stats: RunningMean
) -> dict[str, float]:
    """Epoch metrics: training loss/acc over all ranks, and validation on every rank's shard."""
    from hpcdl import nn  # noqa: PLC0415

    sums = np.array(
        [
            epoch_stats.loss_sum,
            epoch_stats.steps,
            epoch_stats.correct,
            epoch_stats.samples,
            0.0,
            0.0,
            0.0,
        ]
    )
    if val_loader is not None:
        idx = eval_indices(val_size, world.size, world.rank)
        batches = [idx[i : i + batch_size] for i in range(0, len(idx), batch_size)]
        for images, labels in on_device(val_loader.iterate(batches, 0, train=False), xp):
            logits = model.forward(images, train=False)
            loss, _ = nn.softmax_cross_entropy(logits, labels)
            sums[4:] += (float(loss) * len(labels), nn.accuracy_count(logits, labels), len(labels))
    collectives.allreduce_sum(world.comm, sums)
    result = {"loss": sums[0] / max(1, sums[1]), "acc": sums[2] / max(1, sums[3])}
    if val_loader is not None and sums[6]:
        result.update(val_loss=sums[4] / sums[6], val_acc=sums[5] / sums[6])
    return result


if __name__ == "__main__":
    sys.exit(main())
