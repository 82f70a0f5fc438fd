"""`python -m hpcdl.bench calibrate`: measure this machine for the cluster model; write the file.

    mpirun -np 8 --map-by ppr:4:node python -m hpcdl.bench calibrate --data /lustre/imagenet \\
        --stage-dir /local/scratch/me --model resnet50 --input-shape 3,224,224 --classes 1000 \\
        --batch-size 32 --out calib.toml --json

Run it under the job's launcher, with the job's ranks per node, on two nodes or more: then the
interconnect part sees both kinds of link. --model is hpcdl.train's: a name of hpcdl.nn.MODELS,
a user's builder (FILE.py:FN or module:FN returning hpcdl layers or a torch.nn.Module), or
torchvision:NAME. The steps timed are hpcdl.train's engine's for it, built as hpcdl.train builds
it (hpcdl.engines.build_engine; hpcdl.bench.calibrate_step), so a torch model is timed through
the torch engine; without torch installed it ends at once with hpcdl.train's one line, naming
the extra to install. What it measures (docs/cluster-model.md):

- PFS (world rank 0 alone, while the others wait): open + read + close of distinct files of
  --data with 1, 2, 4, ... --threads reader threads. One thread gives the open latency and the
  per-thread bandwidth; when more threads fall short of threads x the one-thread rate by more
  than a third, the rate they reached is written as the file system's limit (opens/s, or
  bytes/s for large files). A site that knows its Lustre better writes its own figures.
- Node-local disk (world rank 0): --local-mb MB written to a temporary file in --stage-dir,
  fsync'ed and removed; nothing else there is touched.
- Peer fetch (world rank 0): two hpcdl-stage processes in a temporary directory of
  --stage-dir, one serving staged copies, one fetching them as the peer tier does; latency and
  one thread's bandwidth (hpcdl.bench.calibrate_peer).
- Interconnect: Allreduce of 4 KiB .. 8 MiB on the node communicator (intra) and on a
  communicator of one rank per node (inter); alpha and beta of the ring formula
  t = 2(p-1) alpha + 2(p-1)/p n beta (fit_alpha_beta). With one node, inter = intra. Then the
  whole world at the same sizes: which formula it follows.
- Compute (hpcdl.bench.calibrate_step): every rank times the engine's step (an engine of its
  own, no reducer) at batch b/2 and b, all at once, as in training; the slowest rank's medians
  give v0 and t of b / v0 + t (hpcdl.clustermodel.speed.fit); 4 gradient bytes a parameter.
- Input (hpcdl.bench.calibrate_input): each rank builds batches of node-local copies of a few
  samples of --data, as the loader does in the rank with --workers 0.
- Contention (hpcdl.bench.calibrate_contention): the trainer's steps again while every node's
  leader runs an hpcdl-stage copying files of --data; the steps' added seconds per copy. Then
  (two nodes or more) again while every node fetches the previous node's copies of those files
  from its stager, all released at once as a job's later epochs are; the added seconds per
  fetch. Both run on in windows of --steps steps until every node's load has landed (at most
  calibrate_contention.LOAD_CAP_S; then not measured, and why).
- The epoch's start (hpcdl.bench.calibrate_boundary, world rank 0 alone): an epoch's
  permutation of the samples, and the replan of a node's plan at two sizes, made-up names.
- Checkpoint (hpcdl.bench.calibrate_checkpoint, world rank 0 alone, only with
  --checkpoint-dir): the checkpoint hpcdl.train writes of --model's engine, saved a few times
  into a temporary directory inside --checkpoint-dir; the median.
- The trainer's step (hpcdl.bench.calibrate_step): the batch built, the engine's step with the
  gradient reducer inside the trainer's stop agreement, back to back on every rank (the mean
  step, the slowest rank; the median of three windows of --steps steps); the factor on the
  allreduce formula is set so that the model's step (hpcdl.clustermodel.step_time, with
  --workers 0) equals it (fit_to_trainer_step).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from hpcdl import config
from hpcdl.bench.calibrate_boundary import measure_boundary
from hpcdl.bench.calibrate_checkpoint import measure_checkpoint
from hpcdl.bench.calibrate_contention import (
    MIN_FILES,
    CopyLoad,
    measure_contention,
    measure_fetch_contention,
)
from hpcdl.bench.calibrate_input import input_samples
from hpcdl.bench.calibrate_peer import measure_peer
from hpcdl.bench.calibrate_pfs import copy_sample, measure_pfs, measure_pfs_together
from hpcdl.bench.calibrate_step import (
    TrainerStep,
    engine_alone,
    measure_compute,
    measure_trainer_step,
    random_batch,
)
from hpcdl.bench.stage_scratch import stage_dir_made
from hpcdl.bench.timing import slowest_rank_median
from hpcdl.clustermodel import calibration
from hpcdl.clustermodel.calibration import (
    Calibration,
    LocalFigures,
    NetworkFigures,
    PeerFigures,
    PfsFigures,
)
from hpcdl.comm import blas_threads
from hpcdl.comm.failure import SystemExitWithMessage, UserError, install_abort_on_exception
from hpcdl.engine import Engine
from hpcdl.helpformat import HelpFormatter

# Allreduce sweep, bytes: up to hpcdl's gradient buckets' sizes (1 MiB first, then 25 MiB by
# default; the model extrapolates beyond 8 MiB linearly, as the alpha-beta form does).
SIZES = [4 << 10, 64 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m hpcdl.bench calibrate",
        description=__doc__.split("\n\n")[0],
        allow_abbrev=False,
        formatter_class=HelpFormatter,
    )
    a = ap.add_argument
    a("--data", required=True, help="the data set directory on the PFS (files are only read)")
    a("--stage-dir", required=True, help="node-local directory (one temporary file written)")
    a("--threads", type=int, default=8, help="most PFS reader threads (1, 2, 4, ... up to it)")
    a("--files", type=int, default=64, help="files read per thread count")
    a("--local-mb", type=int, default=64, help="MB written to the stage dir")
    a(
        "--model",
        default="mlp",
        help="network whose step is timed, as hpcdl.train's --model: "
        "a name of hpcdl.nn.MODELS, FILE.py:FN or module:FN (hpcdl layers, or a torch.nn.Module), "
        "torchvision:NAME",
    )
    a("--batch-size", type=int, default=32, help="per-rank batch of the job")
    a("--input-shape", default="3,32,32", help="C,H,W of one sample")
    a("--augment", default="none", help="the job's --augment, for the input figure")
    a("--classes", type=int, default=10, help="output classes")
    a("--steps", type=int, default=10, help="timed steps per batch size")
    a("--bucket-mb", type=float, default=25.0, help="the job's gradient bucket size (MiB)")
    a("--repeats", type=int, default=5, help="allreduce timings per size (median)")
    a(
        "--checkpoint-dir",
        help="the job's --checkpoint-dir: time one checkpoint of --model "
        "there (a temporary directory, removed after; default: not measured, 0 s)",
    )
    a("--out", help="calibration file to write (TOML; docs/cluster-model.md)")
    a("--json", action="store_true", help="last line: one JSON object")
    return ap


def measure_local(stage_dir: Path, megabytes: int) -> tuple[LocalFigures, PeerFigures]:
    """Write megabytes to a temporary file in stage_dir, fsync, remove it; then the peer fetch
    between two stagers in a temporary directory there (hpcdl.bench.calibrate_peer).

    A stage dir that does not exist yet is made as hpcdl.train makes it (mode 0700, with its
    missing parents) and removed again with them; one that cannot be used is a UserError of
    one line."""
    try:
        with stage_dir_made(stage_dir):
            return _timed_write(stage_dir, megabytes), measure_peer(stage_dir)
    except OSError as exc:
        raise UserError(
            f"hpcdl.bench calibrate: cannot use --stage-dir {stage_dir}: {exc.strerror or exc}; "
            "choose a writable directory on node-local storage"
        ) from None


def _timed_write(stage_dir: Path, megabytes: int) -> LocalFigures:
    block = np.random.default_rng(0).integers(0, 256, 4 << 20, dtype=np.uint8).tobytes()
    fd, name = tempfile.mkstemp(prefix=".hpcdl-calibrate-", dir=stage_dir)
    try:
        t0 = time.perf_counter()
        written = 0
        while written < megabytes * 1_000_000:
            written += os.write(fd, block)
        os.fsync(fd)
        seconds = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(name)
    return LocalFigures(write_bandwidth_Bps=written / seconds)


def fit_alpha_beta(ranks: int, sizes: list[int], seconds: list[float]) -> tuple[float, float]:
    """alpha, beta of the ring formula t = 2(p-1) alpha + 2(p-1)/p n beta from a size sweep.

    alpha from the smallest message, beta from the slope between 1 MiB and the largest: two
    points, because on busy shared cores a least-squares fit over all sizes let one slow small
    message turn the slope negative (measured: beta 0 at 2 emulated nodes)."""
    if ranks <= 1:
        return 0.0, 0.0
    messages, share = 2.0 * (ranks - 1), 2.0 * (ranks - 1) / ranks
    mid = next(i for i, n in enumerate(sizes) if n >= 1 << 20)
    slope = (seconds[-1] - seconds[mid]) / (sizes[-1] - sizes[mid])
    if slope <= 0:  # no growth measured: all of the largest message's time is bandwidth
        slope = seconds[-1] / sizes[-1]
    return seconds[0] / messages, slope / share


def time_allreduce(comm: Any, nbytes: int, repeats: int) -> float:
    """Median seconds of one in-place Allreduce of nbytes (float32), slowest rank."""
    from mpi4py import MPI  # noqa: PLC0415

    buf = np.ones(nbytes // 4, dtype=np.float32)
    comm.Allreduce(MPI.IN_PLACE, buf)  # warm-up: connections, registration
    times = []
    for _ in range(repeats):
        comm.Barrier()
        t0 = time.perf_counter()
        comm.Allreduce(MPI.IN_PLACE, buf)
        times.append(time.perf_counter() - t0)
    return slowest_rank_median(comm, times)


def measure_network(world: Any, repeats: int) -> NetworkFigures:
    """Size sweeps on the node communicator and on one rank per node give alpha and beta;
    a sweep on all ranks tells which formula (ring or hierarchical) the MPI follows here."""
    from mpi4py import MPI  # noqa: PLC0415

    leaders = world.comm.Split(0 if world.local_rank == 0 else MPI.UNDEFINED, world.rank)
    intra = [time_allreduce(world.node_comm, n, repeats) for n in SIZES]
    intra_ab = fit_alpha_beta(world.node_comm.size, SIZES, intra)
    inter_ab = intra_ab
    if world.num_nodes > 1:
        inter = [time_allreduce(leaders, n, repeats) for n in SIZES] if leaders else []
        inter_ab = world.comm.bcast(
            fit_alpha_beta(world.num_nodes, SIZES, inter) if world.rank == 0 else None, root=0
        )
    if leaders:
        leaders.Free()
    fitted = NetworkFigures(intra_ab[0], intra_ab[1], inter_ab[0], inter_ab[1])
    if world.num_nodes == 1:
        return fitted
    whole = [time_allreduce(world.comm, n, repeats) for n in SIZES]
    return closest_algorithm(fitted, world, whole)


def closest_algorithm(net: NetworkFigures, world: Any, seconds: list[float]) -> NetworkFigures:
    """net with the formula whose predictions of the whole world's allreduce lie closest (log
    error) at the sizes of gradient buckets (1 MiB and up: small messages take other
    algorithms), and the median ratio of measured to that formula as algorithm_factor."""
    from hpcdl.clustermodel.equations import allreduce_s  # noqa: PLC0415

    nodes, per_node = world.num_nodes, world.node_comm.size

    def ratios(name: str) -> np.ndarray:
        pairs = [(allreduce_s(net, nodes, per_node, n)[name], t)
                 for n, t in zip(SIZES, seconds) if n >= 1 << 20]  # fmt: skip
        return np.array([t / max(p, 1e-12) for p, t in pairs])

    best = min(calibration.ALGORITHMS, key=lambda name: float(np.sum(np.log(ratios(name)) ** 2)))
    return replace(net, algorithm=best, algorithm_factor=float(np.median(ratios(best))))


def fit_to_trainer_step(
    cal: Calibration, world: Any, args: argparse.Namespace, trained: float
) -> Calibration:
    """cal with network.algorithm_factor set so that the model's step (clustermodel.step_time)
    at this calibration's shape equals the trainer's measured step. The raw allreduce sweep
    chose the algorithm; what hpcdl's reducer adds on top of MPI (its thread, two buckets,
    the ranks' skew that the stop agreement waits for) goes into the factor. Unchanged with one
    node (no inter-node formula to scale), or when the measured step leaves no communication
    exposed to fit (all of it hidden behind backward)."""
    from hpcdl.clustermodel.equations import JobShape, step_time  # noqa: PLC0415

    if world.num_nodes == 1:
        return cal
    shape = JobShape(world.num_nodes, world.node_comm.size, args.batch_size, 1,
                     bucket_mb=args.bucket_mb, workers=0)  # fmt: skip

    def step_s(factor: float) -> float:
        network = replace(cal.network, algorithm_factor=factor)
        return step_time(replace(cal, network=network), shape).step_s

    low, high = 1e-3, 1e3
    if not step_s(low) < trained < step_s(high):
        return cal
    for _ in range(60):  # bisection in log space: step_s grows with the factor
        mid = math.sqrt(low * high)
        low, high = (mid, high) if step_s(mid) < trained else (low, mid)
    return replace(cal, network=replace(cal.network, algorithm_factor=math.sqrt(low * high)))


def measure_alone(args: argparse.Namespace, engine: Engine) -> tuple[Any, ...]:
    """World rank 0, the others waiting: the PFS sweep (figures, rows), the local disk and the
    peer fetch, the epoch's start, and the checkpoint of engine (this rank's engine_alone) with
    --checkpoint-dir (seconds, note)."""
    pfs, rows = measure_pfs(Path(args.data), args.threads, args.files)
    local, peer = measure_local(Path(args.stage_dir), args.local_mb)
    boundary = measure_boundary(Path(args.stage_dir))
    saved = (0.0, "not measured (no --checkpoint-dir)")
    if args.checkpoint_dir:
        batch = random_batch(engine, args.shape, args.classes, 2)
        saved = measure_checkpoint(engine, batch, Path(args.checkpoint_dir))
    return pfs, rows, local, peer, boundary, saved


def contention_measure(
    args: argparse.Namespace, world: Any, pfs: PfsFigures | None
) -> Callable[[float, Any], tuple[float, str, float | None, str]]:
    """measure_trainer_step's contention measure: (quiet step seconds, timed_steps) -> seconds
    lost per copied file, its note, per fetched file (None below two nodes), its note.
    Collective: rank 0's PFS figures (pfs) reach every rank."""
    # how many files the copies need: about twice what one node copies in the timed steps at
    # the rate of the PFS figures just measured (rank 0's), within --local-mb
    rate = world.comm.bcast(args.threads / max(pfs.open_latency_s, 1e-4) if world.rank == 0
                            else None, root=0)  # fmt: skip

    def contention(quiet_s: float, timed_steps) -> tuple[float, str, float | None, str]:
        want = max(MIN_FILES, math.ceil(rate * 2 * quiet_s * (args.steps + 2)))
        chosen = ([], [])  # the node leaders copy
        if world.local_rank == 0:
            chosen = copy_sample(Path(args.data), want, args.local_mb * 1_000_000)
        load = CopyLoad(Path(args.data), args.threads, *chosen)
        stage = Path(args.stage_dir)
        return (
            *measure_contention(world, load, stage, quiet_s, timed_steps),
            *measure_fetch_contention(world, load, stage, quiet_s, timed_steps),
        )

    return contention


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.shape = tuple(int(v) for v in args.input_shape.split(","))
    refused = model_refused(args)
    if refused:
        print(f"python -m hpcdl.bench calibrate: error: {refused}", file=sys.stderr)
        return 2
    from hpcdl.comm.world import init_world  # noqa: PLC0415

    world = init_world()
    # A rank that fails (no files, a stage dir it cannot write) ends every rank with its one
    # line, instead of leaving the others in the next collective.
    install_abort_on_exception(world.comm, world.rank)
    blas_threads.set_for_rank(world.node_comm)  # as hpcdl.train does: a fair share of cores
    with ExitStack() as stack:
        try:  # first: a model that cannot be built stops every rank before anything is timed
            engine = engine_alone(args, world, stack)
        except SystemExitWithMessage as exc:
            if exc.message:
                print(f"python -m hpcdl.bench calibrate: error: {exc.message}", file=sys.stderr)
            return 2
        measured = measure_all(args, world, engine)
    if world.rank == 0:
        write(args, world, *measured)
    return 0


def model_refused(args: argparse.Namespace) -> str | None:
    """hpcdl.train's check of --model, --batch-size and --bucket-mb (hpcdl.config.validate),
    before MPI starts: its one line for a model file that does not load, or a torch model
    without torch (or torchvision) installed, naming what to install; else None."""
    cfg = config.TrainConfig(data=args.data, model=args.model, batch_size=args.batch_size,
                             bucket_mb=args.bucket_mb, progress="none")  # fmt: skip
    try:
        config.validate(cfg)
    except config.ConfigError as exc:
        return str(exc)
    return None


def measure_all(args: argparse.Namespace, world: Any, engine: Engine) -> tuple[Any, ...]:
    """Every part, in order (the module notes); collective. Rank 0's figures: (pfs, rows,
    local, peer, boundary, saved, network, compute, trained, timed); None where not rank 0's."""
    pfs = local = rows = peer = boundary = saved = None  # rank 0's
    if world.rank == 0:
        pfs, rows, local, peer, boundary, saved = measure_alone(args, engine)
    world.comm.Barrier()  # the PFS and the disk were measured alone
    if world.num_nodes > 1:
        pfs = world.comm.bcast(pfs, root=0)
        pfs = measure_pfs_together(world, Path(args.data), args.threads, args.files * 2, pfs)
    network = measure_network(world, args.repeats)
    compute = measure_compute(args, world.comm, engine)
    contention = contention_measure(args, world, pfs)
    with input_samples(world, Path(args.data), Path(args.stage_dir), args.batch_size,
                       args.augment, args.local_mb) as (samples, timed):  # fmt: skip
        trained = measure_trainer_step(args, world, samples, contention)
    return pfs, rows, local, peer, boundary, saved, network, compute, trained, timed


def write(
    args: argparse.Namespace, world: Any, pfs: PfsFigures, rows: list[dict],
    local: LocalFigures, peer: PeerFigures, boundary: Any, saved: tuple[float, str],
    network: NetworkFigures, compute: Any, trained: TrainerStep, timed: str,
) -> None:  # fmt: skip
    """World rank 0: the calibration said, written to --out, and with --json as JSON."""
    where = f"{world.num_nodes} nodes x {world.node_comm.size} ranks"
    source = f"python -m hpcdl.bench calibrate on {where}, {time.ctime()}"
    compute = replace(compute, input_s_per_sample=trained.input_s_per_sample,
                      contention_s_per_file=trained.contention_s_per_file,
                      contention_s_per_fetch=trained.contention_s_per_fetch,
                      permute_s_per_sample=boundary.permute_s_per_sample,
                      replan_s=boundary.replan_s,
                      replan_s_per_entry=boundary.replan_s_per_entry,
                      checkpoint_s=saved[0])  # fmt: skip
    cal = Calibration(pfs, local, network, compute, source=source, peer=peer)
    cal = fit_to_trainer_step(cal, world, args, trained.step_s)
    print(describe(cal, rows, where, trained, timed, boundary.note, saved[1]))
    if args.out:
        calibration.save(args.out, cal)
        print(f"wrote {args.out}")
    if args.json:
        print(json.dumps({**cal.to_json(), "pfs_sweep": rows, "trainer_step_s": trained.step_s}))


def describe(
    cal: Calibration,
    rows: list[dict],
    where: str,
    trained: TrainerStep,
    timed: str,
    replans: str = "",
    saved: str = "not measured",
) -> str:
    """The measured figures, one line per part."""
    p, n, c, peer = cal.pfs, cal.network, cal.compute, cal.peer or calibration.DEFAULT_PEER
    sweep = ", ".join(f"{r['threads']}t {r['opens_per_s']:.0f}/s" for r in rows)
    if read := rows[-1].get("sweep_cut_at_files"):  # fewer files than thread counts
        sweep += f" (thread sweep cut short: --data holds {read} file{'s' * (read > 1)} to read)"
    limit = (
        f"; limit {p.total_opens_per_s:.0f} opens/s" if p.total_opens_per_s
        else f"; limit {p.total_bandwidth_Bps / 1e6:.0f} MB/s" if p.total_bandwidth_Bps
        else ""
    )  # fmt: skip
    return "\n".join([
        f"calibration on {where}:",
        f"  PFS: {p.open_latency_s * 1e3:.2f} ms/open, {p.thread_bandwidth_Bps / 1e6:.0f} MB/s "
        f"per thread; opens/s by threads: {sweep}{limit}",
        f"  local disk: {cal.local.write_bandwidth_Bps / 1e6:.0f} MB/s written",
        f"  peer fetch (two stagers, one host): {peer.fetch_latency_s * 1e3:.2f} ms, "
        f"{peer.thread_bandwidth_Bps / 1e6:.0f} MB/s per thread",
        f"  allreduce: intra alpha {n.intra_alpha_s * 1e6:.1f} us, "
        f"{1e-6 / max(n.intra_beta_s_per_B, 1e-18):.0f} MB/s; inter alpha "
        f"{n.inter_alpha_s * 1e6:.1f} us, {1e-6 / max(n.inter_beta_s_per_B, 1e-18):.0f} MB/s; "
        f"{n.algorithm} x {n.algorithm_factor:.2f}",
        f"  compute: {c.model} step = b / {c.v0:.0f} + {c.t * 1e3:.2f} ms "
        f"({c.step_s(c.batch_size) * 1e3:.1f} ms at batch {c.batch_size}); "
        f"{c.gradient_bytes / 1e6:.1f} MB of gradients",
        "  input (the rank builds its batch, --workers 0): "
        + (f"{c.input_s_per_sample * 1e3:.3f} ms per sample ({timed})" if c.input_s_per_sample
           else timed),
        f"  trainer step (input, compute, reducer, stop agreement, all ranks; mean): "
        f"{trained.step_s * 1e3:.1f} ms (the median of quiet windows of {trained.quiet_note} ms)",
        f"  contention: training loses {c.contention_s_per_file * 1e3:.2f} ms per file a node "
        f"copies ({trained.contention_note})",
        "  contention: training loses "
        + (f"{c.contention_s_per_fetch * 1e3:.2f} ms per file a node fetches from a peer "
           f"({trained.fetch_note})" if c.contention_s_per_fetch is not None
           else f"per peer fetch what a copy costs (per fetch {trained.fetch_note})"),
        f"  epoch start: {c.permute_s_per_sample * 1e9:.1f} ns per sample of the sample order; "
        f"the plan's rewrite {c.replan_s * 1e3:.2f} ms + {c.replan_s_per_entry * 1e6:.2f} us "
        f"per entry ({replans or 'not measured'})",
        f"  checkpoint: {c.checkpoint_s * 1e3:.1f} ms ({saved})",
    ])  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
