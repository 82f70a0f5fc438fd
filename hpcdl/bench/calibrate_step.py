"""`bench calibrate`'s step timings: the compute figures and the trainer's step, of either engine.

The step timed is hpcdl.train's, for --model as hpcdl.train builds it: hpcdl.engines.build_engine
(NOTE [the engine seam] in hpcdl/engine.py) gives hpcdl's own engine for its models and the torch
engine for a torch.nn.Module (`--model FILE.py:FN` returning one, `--model torchvision:NAME`),
and both are stepped through Engine.step on a fixed random batch (SGD with momentum 0.9, the
defaults of hpcdl.train, seed 0).

- Compute (measure_compute): every rank steps an engine of its own (a world of one rank: no
  gradient reducer; the node's ranks still share its cores as in training) at batch b/2 and b,
  all at once; the slowest rank's medians give v0 and t of b / v0 + t
  (hpcdl.clustermodel.speed.fit), and the parameter count the gradient bytes.
- The trainer's step (measure_trainer_step): an engine on the whole world (its reducer with
  --bucket-mb buckets), the batch built, the step inside the trainer's stop agreement, back to
  back on every rank. Then the same steps again beside a load (the stagers' copies or peer
  fetches, hpcdl.bench.calibrate_contention): in windows of --steps steps, one after the other,
  until every rank's load has landed (or calibrate_contention.LOAD_CAP_S passed), so the figure
  covers the whole load, not the part of it that happened to land in one window.
"""

from __future__ import annotations

import argparse
import signal
import time
from contextlib import ExitStack
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from hpcdl.bench.calibrate_contention import Window, load_goes_on
from hpcdl.bench.timing import slowest_rank_mean, slowest_rank_median
from hpcdl.clustermodel import speed
from hpcdl.clustermodel.calibration import ComputeFigures
from hpcdl.comm.failure import StopAgreement, SystemExitWithMessage, agree_on_errors
from hpcdl.comm.world import World
from hpcdl.config import TrainConfig
from hpcdl.engine import Engine
from hpcdl.engines import build_engine

BACKWARD_SHARE = 2 / 3  # of forward + backward: backward does about twice forward's work
QUIET_WINDOWS = 3  # the trainer's quiet step: the median of this many windows
WARM_UP = 3  # steps before each timing


def step_engine(args: argparse.Namespace, world: World, stack: ExitStack) -> Engine:
    """hpcdl.train's engine for args.model (hpcdl.engines.build_engine) on CPU, fp32, SGD with
    momentum, seed 0, the gradient reducer with args.bucket_mb buckets where world has more
    than one rank; collective over world. Its reducer is closed when stack closes."""
    cfg = TrainConfig(model=args.model, batch_size=args.batch_size, bucket_mb=args.bucket_mb,
                      device="cpu", precision="fp32", seed=0)  # fmt: skip
    return build_engine(cfg, world, stack, tuple(args.shape), args.classes, np, False)


def engine_alone(args: argparse.Namespace, world: World, stack: ExitStack) -> Engine:
    """step_engine for this rank alone (no reducer), built on every rank of world at once so
    that the node's ranks share its cores as in training; collective. A model that cannot be
    built (a builder that fails, a torchvision name that does not exist) is
    SystemExitWithMessage on every rank, with its one line on world rank 0."""
    from mpi4py import MPI  # noqa: PLC0415

    alone = replace(world, comm=MPI.COMM_SELF, rank=0, size=1)
    engine, error = None, None
    try:
        engine = step_engine(args, alone, stack)
    except SystemExitWithMessage as exc:
        error = exc.message or f"--model {args.model} could not be built"
    agree_on_errors(world.comm, world.rank, error)
    return engine


def random_batch(engine: Engine, shape: tuple[int, ...], classes: int, batch: int) -> tuple:
    """A fixed random batch (seed 0) as the engine's step takes it (Engine.batches)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, *shape)).astype(np.float32)
    y = rng.integers(0, classes, batch).astype(np.int64)
    return next(iter(engine.batches([(x, y)])))


def measure_compute(args: argparse.Namespace, comm: Any, engine: Engine) -> ComputeFigures:
    """Every rank steps its engine_alone at b/2 and b at once (hpcdl.bench.timing's
    convention); the slowest rank's medians give v0 and t."""
    batches = sorted({max(1, args.batch_size // 2), args.batch_size})
    if len(batches) == 1:
        batches = [1, 2]
    medians = []
    for batch in batches:
        images, labels = random_batch(engine, args.shape, args.classes, batch)
        for _ in range(WARM_UP):
            engine.step(images, labels, 0.01, False, None, True)
        comm.Barrier()
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            engine.step(images, labels, 0.01, False, None, True)  # timed: the device's time
            times.append(time.perf_counter() - t0)
        medians.append(slowest_rank_median(comm, times))
    try:
        fit = speed.fit([float(b) for b in batches], medians)
        v0, t = fit.v0, fit.t  # the fit holds t >= 0
    except speed.ScalingFitError:  # too noisy to split: all of the step grows with b
        v0, t = batches[-1] / medians[-1], 0.0
    return ComputeFigures(
        model=args.model,
        batch_size=args.batch_size,
        v0=v0,
        t=t,
        backward_fraction=BACKWARD_SHARE,
        gradient_bytes=len(engine.model.params) * 4,  # float32 gradients, one per parameter
    )


@dataclass(frozen=True)
class TrainerStep:
    step_s: float  # the mean step, slowest rank, batch building included where timed
    input_s_per_sample: float  # of it, building the batch, per sample (0: not timed)
    contention_s_per_file: float = 0.0  # while the stagers copy (calibrate_contention)
    contention_note: str = "not measured"
    contention_s_per_fetch: float | None = None  # while they fetch from peers (None: not measured)
    fetch_note: str = "not measured"
    quiet_note: str = ""  # each quiet window's step, ms


def measure_trainer_step(
    args: argparse.Namespace, world: World, samples: Any, contention: Any = None
) -> TrainerStep:
    """hpcdl.train's step as --workers 0 runs it, slowest rank: the batch built from node-local
    copies of --data (samples: hpcdl.bench.calibrate_input; None: no data, no building), then
    the engine's step with the gradient reducer (step_engine: --bucket-mb buckets on its
    thread, overlapping backward; the loss's finiteness flag rides in the last bucket, as in
    hpcdl.train, so no collective of its own), inside the trainer's stop agreement (a
    nonblocking allreduce begun before the step and waited for after it), back to back on every
    rank. The mean over the steps, not the median: an epoch lasts the sum of its steps
    (hpcdl.bench.timing). Timed in QUIET_WINDOWS windows of --steps steps one after the other,
    and the median window's mean taken: on a shared machine one window can be a quarter off
    the next (docs/cluster-model.md, section 3b).

    contention(quiet step s, timed) -> (seconds per copy, note, seconds per fetch, note): then
    the same steps again while the stagers copy, and while they fetch from peers
    (hpcdl.bench.calibrate_contention); timed(beside) runs them until beside's load is done."""
    with ExitStack() as stack:
        engine = step_engine(args, world, stack)
        batch = random_batch(engine, args.shape, args.classes, args.batch_size)
        stop = StopAgreement(world.comm)  # as hpcdl.startup makes it for every run
        try:
            windows, copies = _timed_windows(args, world, engine, batch, stop, samples, contention)
        except BaseException:
            stop.abandon()  # this rank alone: MPI_Abort ends the agreement in flight
            raise
        stop.close()  # every rank together
    if stop.signal_name:  # caught while the steps ran: what the signal would have done then
        signal.raise_signal(signal.Signals[stop.signal_name])
    step_s, building = sorted(windows)[len(windows) // 2]
    quiet_ms = ", ".join(f"{w * 1e3:.1f}" for w, _ in windows)
    return TrainerStep(step_s, building / args.batch_size, *copies, quiet_note=quiet_ms)


def _timed_windows(
    args: argparse.Namespace, world: World, engine: Engine, batch: tuple, stop: StopAgreement,
    samples: Any, contention: Any,
) -> tuple[list[tuple[float, float]], tuple]:  # fmt: skip
    """((step, building) of each quiet window, slowest rank; what contention returned, or ()
    without it or after a stop signal)."""
    build = samples.build if samples is not None else None
    windows = []
    for _ in range(QUIET_WINDOWS):
        quiet = _timed_steps(engine, batch, stop, args.steps, build).seconds
        windows.append((slowest_rank_mean(world.comm, [whole for _, whole in quiet]),
                        slowest_rank_mean(world.comm, [b for b, _ in quiet]) if build
                        else 0.0))  # fmt: skip
        if stop.signal_name:
            return windows, ()
    if contention is None:
        return windows, ()
    step_s = sorted(windows)[len(windows) // 2][0]

    def timed(beside) -> Window:
        loaded = _timed_steps(engine, batch, stop, args.steps, build, beside, world.comm)
        return replace(loaded, seconds=[whole for _, whole in loaded.seconds])

    return windows, contention(step_s, timed)


def _timed_steps(
    engine: Engine, batch: tuple, stop: StopAgreement, steps: int, build, beside=None,
    comm: Any = None,
) -> Window:  # fmt: skip
    """Window of (seconds building the batch, seconds of the whole step) of each step after
    WARM_UP ones. The step trains on the fixed batch: what was built only costs its time. Each
    step runs inside stop's agreement, as hpcdl.train's do; the steps end early, on every rank
    at once, when it says to stop (a signal).

    beside: a load (hpcdl.bench.calibrate_contention) started just before the timed steps and
    stopped just after them; they run in windows of `steps` steps until the load is done on
    every rank (calibrate_contention.load_goes_on, agreed over comm)."""
    times, stopped = _steps(engine, batch, stop, WARM_UP, build)
    began, unfinished = time.time(), False
    if not stopped:
        if beside:
            beside.start()
        began, times = time.time(), []
        while True:
            window, stopped = _steps(engine, batch, stop, steps, build)
            times += window
            if beside is None or stopped:
                break
            more, unfinished = load_goes_on(comm, beside, began)
            if not more:
                break
    if beside:
        beside.stop()
    return Window(times, began, time.time(), unfinished)


def _steps(
    engine: Engine, batch: tuple, stop: StopAgreement, count: int, build
) -> tuple[list[tuple[float, float]], bool]:
    """count steps, each inside stop's agreement: ((building s, whole step s) of each, whether
    the agreement said to stop, which ends them at that step)."""
    images, labels = batch
    times = []
    for _ in range(count):
        t0 = time.perf_counter()
        if build:
            build()
        t1 = time.perf_counter()
        stop.start_step()
        engine.step(images, labels, 0.01, False, None, True)
        stopped = stop.should_stop()
        times.append((t1 - t0, time.perf_counter() - t0))
        if stopped:
            return times, True
    return times, False
