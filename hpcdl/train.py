"""`mpirun -np N python -m hpcdl.train ...`: data-parallel training, one MPI rank per GPU.

Read top to bottom: main (configuration, MPI), then train: the loop. Start-up (device, data,
model, resume, staging, loaders) builds a Run (hpcdl.startup, hpcdl.run) that owns every resource
and closes them on every exit path. The step is the run's engine's (hpcdl.engine: hpcdl's own
models or a torch.nn.Module; the loop does not know which), which averages the gradients with a
bucketed allreduce that overlaps with backward (hpcdl.comm.reducer). Every rank runs this file;
rank 0 prints and writes metrics.
"""

# ruff: noqa: E402  (the stop signals are caught before the imports: NOTE [stop signals])
from __future__ import annotations

from hpcdl import stop_signals

if __name__ == "__main__":  # the imports below take half a second, a torch model many more
    stop_signals.catch()

import atexit
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from hpcdl import diag, launch, resume, startup
from hpcdl.comm import collectives, ulfm
from hpcdl.comm.failure import (
    SystemExitWithMessage,
    UserError,
    install_abort_on_exception,
)
from hpcdl.comm.world import World, init_world
from hpcdl.config import ConfigError, TrainConfig, parse_args
from hpcdl.data.dataset import DataError
from hpcdl.data.pool import LoaderFault, LoaderTimeout
from hpcdl.data.sampler import eval_indices
from hpcdl.metrics import MetricsWriter, RunningMean
from hpcdl.mpi_errors import lost_ranks
from hpcdl.nn.loss_watch import LossWatch
from hpcdl.nn.step import StepResult
from hpcdl.run import Position, Run

EXIT_STOPPED_BY_SIGNAL = 3
EXIT_LOADER_TIMEOUT = 4  # a loader worker stayed silent past --loader-timeout
EXIT_DATA_ERROR = 1  # a sample or file that cannot be read mid-run
EXIT_LOADER_FAULT = 2  # a loader worker died


def main(argv: list[str] | None = None) -> int:
    stop_signals.catch()  # caught until the process exits (NOTE [stop signals])
    try:
        cfg = parse_args(argv)
    except ConfigError as exc:
        return startup.fail_once(f"hpcdl.train: error: {exc}")
    world = init_world()
    install_abort_on_exception(world.comm, world.rank)
    if world.is_root:
        launch.record_outcome(launch.STARTED)  # for `python -m hpcdl.launch` (a lost node)
    try:
        return train_through_lost_ranks(cfg, world)
    except (DataError, LoaderFault) as exc:  # mid-run: one line from this rank (comm.failure)
        status = EXIT_DATA_ERROR if isinstance(exc, DataError) else EXIT_LOADER_FAULT
        status = EXIT_LOADER_TIMEOUT if isinstance(exc, LoaderTimeout) else status
        raise UserError(str(exc), status) from None


def train_through_lost_ranks(cfg: TrainConfig, world: World) -> int:
    """train_to_the_end(); with --on-node-loss continue, again on the survivors after a rank is
    lost, from the latest checkpoint (NOTE [recovering from lost ranks] in hpcdl/comm/ulfm.py)."""
    while True:
        try:
            return ulfm.exiting(train_to_the_end(cfg, world))
        except Exception as exc:
            if not lost_ranks(exc):
                raise
            if cfg.on_node_loss != "continue":  # one line naming them, never a traceback
                raise UserError(ulfm.lost_under_stop(world), ulfm.EXIT_RANKS_LOST) from None
            failed_at = time.monotonic()
        diag.dump_flight("ranks lost (--on-node-loss continue)")
        world = ulfm.recover(world, failed_at)
        install_abort_on_exception(world.comm, world.rank)
        atexit.register(ulfm.leave_without_finalize, world.comm)
        cfg = replace(cfg, resume="auto")


def train_to_the_end(cfg: TrainConfig, world: World) -> int:
    """train() on this world, whose rank 0 (after a recovery: the survivors') says how the run
    ended: `finished` for hpcdl.launch when it did, the one line when it had nothing to do."""
    try:
        status = train(cfg, world)
    except resume.NothingToTrain as exc:  # every rank: the resumed run is already done
        if world.is_root:
            print(exc.message, flush=True)
            record_finished(cfg, exc.message)
        world.comm.Barrier()  # the line is out before any rank exits
        status = 0
    except SystemExitWithMessage as exc:
        return startup.fail_once(exc.message and f"hpcdl.train: error: {exc.message}", world.comm)
    if world.is_root and status == 0:
        launch.record_outcome(launch.FINISHED)
    return status


def record_finished(cfg: TrainConfig, line: str) -> None:
    """A `finished` record in --metrics: the run's own word that it had nothing left to train
    (the last job of a chain), which the job template reads as completion (docs/slurm.md)."""
    writer = MetricsWriter(cfg.metrics)
    try:
        writer.write("finished", reason=line)
    finally:
        writer.close()


def train(cfg: TrainConfig, world: World) -> int:
    """The loop. Every rank runs it; rank 0 prints and writes metrics. Returns the exit status."""
    with startup.start_run(cfg, world) as run:  # closes every resource, however the run ends
        totals, history, watch = RunningMean(), {}, LossWatch(run.engine.xp)
        global_step, stopped_by, checkpoint_path = run.start.global_step, None, None
        run_start = time.perf_counter()
        for epoch in range(run.start.epoch, cfg.epochs):
            run.progress.start_epoch(epoch)
            resumed = epoch == run.start.epoch  # mid-epoch: its sums so far, from the checkpoint
            epoch_stats = RunningMean(*run.start.epoch_sums) if resumed else RunningMean()
            epoch_start, samples_before = time.perf_counter(), epoch_stats.samples
            step = run.start.step_in_epoch if resumed else 0
            t_wait = time.perf_counter()
            for images, labels in run.batches(epoch, first=step):
                run.stop.start_step()  # the ranks agree on stop signals while the step runs
                diag.begin_step(global_step)  # what the timeline and the stall inspector show
                lr = run.schedule(global_step)
                mix = bool(cfg.params_sync_every) and (global_step + 1) % cfg.params_sync_every == 0
                logged = (global_step + 1) % cfg.metrics_every == 0
                result = run.engine.step(images, labels, lr, mix, t_wait, timed=logged)
                # loss, flag and count stay on the device (NOTE [device scalars]); the step is
                # numbered from 1, as in the metrics and TensorBoard
                watch.note(result.nonfinite_ranks, result.loss, global_step + 1, epoch)
                correct = run.engine.correct(result.logits, labels)
                for stats in (epoch_stats, totals):
                    stats.add(result.times, result.loss, correct, len(labels))
                step, global_step = step + 1, global_step + 1
                run.consumed(epoch, step)  # with staging: the stager may evict what is behind
                run.progress.update(step, epoch_stats)

                end_of_epoch = step == run.steps_in(epoch)
                stopped_by = run.stop.signal_name if run.stop.should_stop() else None
                at_max_steps = bool(cfg.max_steps) and global_step >= cfg.max_steps
                saving = checkpoint_due(cfg, global_step, end_of_epoch or at_max_steps, stopped_by)
                if logged or end_of_epoch or at_max_steps or stopped_by or saving:
                    stop_if_loss_not_finite(run, watch)
                if logged:
                    log_step(run, global_step, epoch, result, lr)
                if (end_of_epoch or at_max_steps) and not stopped_by:
                    seconds = time.perf_counter() - epoch_start
                    trained = epoch_stats.samples - samples_before  # by this job: the rate's
                    history = end_epoch(run, epoch, step, epoch_stats, seconds, trained)
                if saving:
                    at = (epoch + 1, 0) if end_of_epoch else (epoch, step)
                    checkpoint_path = resume.save(run, Position(*at, global_step), epoch_stats)
                if stopped_by or at_max_steps:
                    break
                t_wait = time.perf_counter()
            if stopped_by or (cfg.max_steps and global_step >= cfg.max_steps):
                break
        elapsed = time.perf_counter() - run_start
        write_summary(run, history, totals, elapsed, stopped_by, checkpoint_path)
        images_per_s = totals.samples * world.size / max(elapsed, 1e-9)
    return final_status(world, history, images_per_s, stopped_by, checkpoint_path)


def checkpoint_due(
    cfg: TrainConfig, global_step: int, at_the_end: bool, stopped_by: str | None
) -> bool:
    """The one checkpoint rule: at the end of every epoch and at --max-steps (at_the_end), when
    a signal stops the run, and every --checkpoint-every steps; never without --checkpoint-dir.
    A run --max-steps stopped is resumed there: with nothing to train, or with a larger one."""
    every = bool(cfg.checkpoint_every) and global_step % cfg.checkpoint_every == 0
    return bool(cfg.checkpoint_dir) and (at_the_end or stopped_by is not None or every)


def log_step(run: Run, global_step: int, epoch: int, result: StepResult, lr: float) -> None:
    """A `step` metrics record and, on rank 0 with staging, how far staging runs ahead."""
    scaler = run.engine.scaler  # --precision fp16
    run.metrics.write(
        "step",
        step=global_step,
        epoch=epoch,
        loss=float(result.loss),
        lr=lr,
        **vars(result.times),
        samples_per_s=run.global_batch / max(result.times.t_step, 1e-9),
        **({"loss_scale": scaler.scale, "applied": result.applied} if scaler else {}),
    )
    ahead = run.staging.progress_record() if run.staging and run.world.is_root else None
    if ahead:
        run.metrics.write("staging", step=global_step, epoch=epoch, **ahead)


def end_epoch(
    run: Run, epoch: int, steps: int, epoch_stats: RunningMean, seconds: float, trained: int
) -> dict[str, float]:
    """Average BatchNorm statistics, evaluate, report the epoch; returns its metrics. trained:
    this rank's samples of the epoch in this job's `seconds` (a resumed epoch's sums hold more)."""
    run.engine.average_buffers()
    history = evaluate(run, epoch_stats)
    values = {k: history[k] for k in ("loss", "acc", "val_loss", "val_acc") if k in history}
    run.progress.end_epoch(steps, values)
    stage_stats = run.staging.epoch_stats() if run.staging else None
    run.metrics.write(
        "epoch",
        epoch=epoch,
        **values,
        seconds=seconds,
        images_per_s=trained * run.world.size / max(seconds, 1e-9),
        staging=stage_stats,
        staging_nodes=staging_nodes(run.world, stage_stats),
    )
    return history


def write_summary(
    run: Run,
    history: dict[str, float],
    totals: RunningMean,
    elapsed: float,
    stopped_by: str | None,
    checkpoint_path: Path | None,
) -> None:
    """The `summary` metrics record (collective: bad samples and staging are gathered)."""
    world = run.world
    bad = sum(world.comm.allgather(run.loader.stats().get("bad_samples", 0)))  # frees the GIL
    stage_stats = run.staging.epoch_stats() if run.staging else None
    run.metrics.write(
        "summary",
        world_size=world.size,
        global_batch=run.global_batch,
        epochs=run.cfg.epochs,
        steps=run.start.global_step + totals.steps,
        val_accuracy=history.get("val_acc"),
        val_loss=history.get("val_loss"),
        train_loss=history.get("loss"),
        images_per_s=totals.samples * world.size / max(elapsed, 1e-9),
        mean_step=totals.mean_parts(),
        cuda_aware=run.cuda_aware,
        sync=run.cfg.sync,
        staging=stage_stats,
        staging_nodes=staging_nodes(world, stage_stats),
        bad_samples=bad,
        precision=run.cfg.precision,
        skipped_steps=run.engine.scaler.skipped if run.engine.scaler else 0,
        stopped_by_signal=stopped_by is not None,
        checkpoint=str(checkpoint_path) if checkpoint_path else None,
    )


def final_status(
    world: World,
    history: dict[str, float],
    images_per_s: float,
    stopped_by: str | None,
    checkpoint_path: Path | None,
) -> int:
    """Print the run's last line on rank 0 (also with --quiet); return the exit status."""
    if stopped_by:
        diag.dump_flight(f"stopped by signal {stopped_by}")
        where = (
            f"checkpoint at {checkpoint_path}"
            if checkpoint_path
            else "no checkpoint written (no --checkpoint-dir)"
        )
        if world.is_root:
            print(f"hpcdl.train: stopped by signal {stopped_by}, {where}", flush=True)
        return EXIT_STOPPED_BY_SIGNAL
    if world.is_root:
        print(final_line(history, images_per_s), flush=True)
    return 0


def final_line(history: dict[str, float], images_per_s: float) -> str:
    """The run's result: validation accuracy, else the last epoch's training loss and accuracy."""
    rate = f"({images_per_s:.0f} images/s)"
    if "val_acc" in history:
        return f"hpcdl.train: final val_acc {history['val_acc']:.4f} {rate}"
    return (
        f"hpcdl.train: final train loss {history['loss']:.4f}, "
        f"train acc {history['acc']:.4f} {rate}"
    )


def stop_if_loss_not_finite(run: Run, watch: LossWatch) -> None:
    """Stop every rank with one message when any rank's loss was NaN or infinite since the run
    began. Collective; read every --metrics-every steps and before any save or stop.

    The gradient allreduce carried each step's flag (hpcdl.nn.step), so every rank holds the
    same count; with --sync params:K, or no reducer, one allreduce here sums the ranks' own."""
    world, flag = run.world, np.array([watch.any_rank_count()])
    if world.size > 1 and not run.engine.flags_agreed:
        collectives.allreduce_sum(world.comm, flag)
    if not flag[0]:
        return
    firsts = world.comm.allgather(watch.first())
    seen = [(*f, r) for r, f in enumerate(firsts) if f is not None]
    step, epoch, loss, bad = min(seen, key=lambda first: (first[0], first[3]))
    raise SystemExitWithMessage(
        f"loss became {loss} at step {step} (epoch {epoch + 1}) on rank {bad}; "
        "lower --lr or check the input data"
        if world.rank == 0
        else None
    )


def staging_nodes(world: World, stats: dict | None) -> list[dict] | None:
    """Staging figures per node, on rank 0: the node's files and bytes staged, and hits and
    misses summed over its ranks. Collective; None when staging is off."""
    if stats is None:
        return None
    shared = {k: stats[k] for k in ("files_staged", "bytes_staged", "pfs_opens", "peer_files",
                                    "peer_bytes")}  # fmt: skip
    return world.per_node(shared, {k: stats[k] for k in ("hits", "misses")})


@diag.spanned(diag.Kind.EVAL)
def evaluate(run: Run, epoch_stats: RunningMean) -> dict[str, float]:
    """Epoch metrics: training loss/acc over all ranks, and validation on every rank's shard."""
    world, batch_size = run.world, run.cfg.batch_size
    sums = np.array(
        [
            float(epoch_stats.loss_sum),
            epoch_stats.steps,
            int(epoch_stats.correct),
            epoch_stats.samples,
            0.0,
            0.0,
            0.0,
        ]
    )
    if run.val_loader is not None:
        idx = eval_indices(len(run.val_ds), world.size, world.rank)
        batches = [idx[i : i + batch_size] for i in range(0, len(idx), batch_size)]
        host = run.val_loader.iterate(batches, 0, train=False)
        for images, labels in run.engine.batches(host):  # (B, C, H, W) float32, (B,) int64
            loss, correct = run.engine.evaluate(images, labels)
            sums[4:] += (loss * len(labels), correct, len(labels))
    collectives.allreduce_sum(world.comm, sums)
    result = {"loss": sums[0] / max(1, sums[1]), "acc": sums[2] / max(1, sums[3])}
    if run.val_loader is not None and sums[6]:
        result.update(val_loss=sums[4] / sums[6], val_acc=sums[5] / sums[6])
    return result


if __name__ == "__main__":
    sys.exit(main())
