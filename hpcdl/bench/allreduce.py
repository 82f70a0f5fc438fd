"""`mpirun -np N python -m hpcdl.bench allreduce`: GradientReducer vs flat and per-array Allreduce.

For each gradient size list (ResNet-20's arrays; a 25M-parameter ResNet-50-like list) it measures,
in the same run: one raw mpi4py Allreduce of the whole flat buffer ("flat"), one Allreduce per
array ("naive", what per-tensor reduction without fusion does), and the GradientReducer with
buckets marked ready back-to-front. Bus bandwidth = bytes * 2(p-1)/p / seconds (nccl-tests'
definition). A second part runs a synthetic backward (NumPy GEMMs, which release the GIL) that
marks buckets ready as it goes, and reports the exposed communication: how long the step waits
after backward ends, as a fraction of the raw flat Allreduce time.

Across nodes it also times a two-level reduction of the flat buffer written with mpi4py
("2-level": Reduce inside each node, Allreduce among the node leaders, Bcast inside each node).
That is what a node-aware reducer in hpcdl would do, measured against the MPI's own collectives
(Open MPI's coll_han does the same inside the library). `bench interconnect` runs this
benchmark across emulated nodes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from hpcdl.bench.timing import slowest_rank_median
from hpcdl.comm.reducer import GradientReducer
from hpcdl.helpformat import HelpFormatter


def resnet20_shapes(classes: int = 10) -> list[tuple[int, ...]]:
    """Parameter shapes of CIFAR ResNet-20 (conv weights, BN scale/shift, final dense)."""
    shapes: list[tuple[int, ...]] = [(16, 3, 3, 3), (16,), (16,)]
    cin = 16
    for cout in (16, 32, 64):
        for _ in range(3):
            shapes += [(cout, cin, 3, 3), (cout,), (cout,), (cout, cout, 3, 3), (cout,), (cout,)]
            cin = cout
    return shapes + [(classes, 64), (classes,)]


def resnet50_like_shapes() -> list[tuple[int, ...]]:
    """161 arrays, about 25.6M parameters: ResNet-50's bottleneck layout."""
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    cin = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            out = width * 4
            shapes += [(width, cin, 1, 1), (width,), (width,)]
            shapes += [(width, width, 3, 3), (width,), (width,)]
            shapes += [(out, width, 1, 1), (out,), (out,)]
            if b == 0:
                shapes += [(out, cin, 1, 1), (out,), (out,)]
            cin = out
    return shapes + [(1000, 2048), (1000,)]


MODELS = {"resnet20": resnet20_shapes, "resnet50_like": resnet50_like_shapes}


def _time(comm, fn, repeats: int) -> float:
    """Seconds of fn() over repeats, ranks synchronised before each try (hpcdl.bench.timing)."""
    samples = []
    for _ in range(repeats):
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return slowest_rank_median(comm, samples)


class TwoLevel:
    """Reduce inside the node, Allreduce among node leaders, Bcast inside the node (in place)."""

    def __init__(self, comm) -> None:
        from mpi4py import MPI  # noqa: PLC0415

        self.node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        leader = self.node.rank == 0
        self.leaders = comm.Split(0 if leader else MPI.UNDEFINED, comm.rank)
        self.nodes = comm.allreduce(1 if leader else 0)

    def allreduce(self, buf: np.ndarray) -> None:
        from mpi4py import MPI  # noqa: PLC0415

        if self.node.rank == 0:
            self.node.Reduce(MPI.IN_PLACE, buf, op=MPI.SUM, root=0)
            self.leaders.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        else:
            self.node.Reduce(buf, None, op=MPI.SUM, root=0)
        self.node.Bcast(buf, root=0)

    def close(self) -> None:
        if self.leaders != _comm_null():
            self.leaders.Free()
        self.node.Free()


def _comm_null():
    from mpi4py import MPI  # noqa: PLC0415

    return MPI.COMM_NULL


def measure(comm, shapes: list[tuple[int, ...]], bucket_mb: float, repeats: int) -> dict:
    from mpi4py import MPI  # noqa: PLC0415

    sizes = [int(np.prod(s)) for s in shapes]
    total = sum(sizes)
    flat = np.random.default_rng(comm.rank).standard_normal(total).astype(np.float32)
    arrays = [np.ones(n, np.float32) for n in sizes]
    ends = np.cumsum(sizes[::-1])  # back-to-front readiness, as backward produces it
    # as hpcdl.train runs it: the gradients are of loss / world size, the reducer only sums
    reducer = GradientReducer(comm, flat, bucket_mb=bucket_mb, prescaled=True)

    def run_flat() -> None:
        comm.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)

    def run_naive() -> None:
        for a in arrays:
            comm.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM)

    def run_reducer() -> None:
        reducer.begin_step()
        for end in ends:
            reducer.mark_ready(int(end))
        reducer.wait()

    two_level = TwoLevel(comm)
    for fn in (run_flat, run_naive, run_reducer):  # warm up connections and buffers
        fn()
    t_flat = _time(comm, run_flat, repeats)
    t_naive = _time(comm, run_naive, repeats)
    t_reducer = _time(comm, run_reducer, repeats)
    t_two_level = None
    if two_level.nodes > 1:
        two_level.allreduce(flat)
        t_two_level = _time(comm, lambda: two_level.allreduce(flat), repeats)
    two_level.close()
    reducer.close()
    p = comm.size
    factor = 2 * (p - 1) / p
    nbytes = total * 4

    def busbw(t: float) -> float:
        return nbytes * factor / t / 1e9

    return {
        "arrays": len(sizes),
        "parameters": total,
        "bytes": nbytes,
        "flat_s": t_flat,
        "naive_s": t_naive,
        "reducer_s": t_reducer,
        "flat_busbw_gbs": busbw(t_flat),
        "naive_busbw_gbs": busbw(t_naive),
        "reducer_busbw_gbs": busbw(t_reducer),
        "nodes": two_level.nodes,
        "two_level_s": t_two_level,
        "two_level_busbw_gbs": busbw(t_two_level) if t_two_level else None,
    }


def measure_overlap(comm, total: int, bucket_mb: float, backward_factor: float) -> dict:
    """Exposed communication with a synthetic backward lasting ~backward_factor x the allreduce."""
    from mpi4py import MPI  # noqa: PLC0415

    grads = np.ones(total, np.float32)
    comm.Allreduce(MPI.IN_PLACE, grads, op=MPI.SUM)
    t_raw = _time(comm, lambda: comm.Allreduce(MPI.IN_PLACE, grads, op=MPI.SUM), 5)
    a = np.random.default_rng(0).standard_normal((192, 192)).astype(np.float32)
    t0 = time.perf_counter()
    for _ in range(20):
        a @ a
    gemm_s = (time.perf_counter() - t0) / 20
    chunks = 32
    gemms_per_chunk = max(1, int(backward_factor * t_raw / gemm_s / chunks))
    reducer = GradientReducer(comm, grads, bucket_mb=bucket_mb, prescaled=True)
    exposed, backward = [], []
    for _ in range(5):
        comm.Barrier()
        reducer.begin_step()
        t0 = time.perf_counter()
        for c in range(1, chunks + 1):
            for _ in range(gemms_per_chunk):
                a @ a
            reducer.mark_ready(total * c // chunks)
        backward.append(time.perf_counter() - t0)
        t1 = time.perf_counter()
        reducer.wait()
        exposed.append(time.perf_counter() - t1)
    reducer.close()
    t_exposed = slowest_rank_median(comm, exposed)
    return {
        "raw_allreduce_s": t_raw,
        "backward_s": slowest_rank_median(comm, backward),
        "exposed_s": t_exposed,
        "exposed_fraction_of_raw": t_exposed / t_raw,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m hpcdl.bench allreduce",
        description=__doc__.split("\n")[0],
        allow_abbrev=False,
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="gradient bucket size in MiB")
    parser.add_argument("--repeats", type=int, default=10, help="timed repetitions per case")
    parser.add_argument(
        "--backward-factor",
        type=float,
        default=3.0,
        help="synthetic backward duration as a multiple of the raw allreduce (0: no overlap test)",
    )
    parser.add_argument(
        "--models",
        default=",".join(MODELS),
        help=f"comma-separated gradient lists to time, from {', '.join(MODELS)} (default: all)",
    )
    parser.add_argument("--json", action="store_true", help="last line: one JSON object")
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The flags, checked (parser.error, status 2) before MPI starts."""
    args = parser.parse_args(argv)
    unknown = [m for m in args.models.split(",") if m not in MODELS]
    if unknown:
        parser.error(f"--models: unknown {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    if args.repeats < 1 or args.bucket_mb <= 0 or args.backward_factor < 0:
        parser.error("--repeats must be >= 1, --bucket-mb > 0 and --backward-factor >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_args(parser, argv)
    models = args.models.split(",")
    from mpi4py import MPI  # noqa: PLC0415

    comm = MPI.COMM_WORLD
    if comm.size < 2:  # bus bandwidth is 2(p-1)/p bytes per second: 0 on one rank
        print(
            f"{parser.prog}: error: it times the allreduce between ranks and got 1 rank; run "
            f"it as mpirun -np N {parser.prog} (N >= 2)",
            file=sys.stderr,
        )
        return 2
    results = {name: measure(comm, MODELS[name](), args.bucket_mb, args.repeats) for name in models}
    largest = max(r["parameters"] for r in results.values())
    overlap = None
    if args.backward_factor > 0:
        overlap = measure_overlap(comm, largest, args.bucket_mb, args.backward_factor)
    if comm.rank != 0:
        return 0
    # Open MPI's version string ends in a NUL, which makes grep call the output binary
    library = MPI.Get_library_version().replace("\0", "").splitlines()[0]
    print(f"ranks: {comm.size}  library: {library}")
    print(
        f"{'gradients':<15}{'arrays':>7}{'MB':>8}{'flat GB/s':>11}{'reducer GB/s':>14}"
        f"{'naive GB/s':>12}{'reducer/flat':>14}{'reducer/naive':>15}{'2-level GB/s':>14}"
    )
    for name, r in results.items():
        print(
            f"{name:<15}{r['arrays']:>7}{r['bytes'] / 1e6:>8.1f}{r['flat_busbw_gbs']:>11.2f}"
            f"{r['reducer_busbw_gbs']:>14.2f}{r['naive_busbw_gbs']:>12.2f}"
            f"{r['reducer_busbw_gbs'] / r['flat_busbw_gbs']:>14.2f}"
            f"{r['reducer_busbw_gbs'] / r['naive_busbw_gbs']:>15.2f}"
            + (f"{r['two_level_busbw_gbs']:>14.2f}" if r["two_level_s"] else f"{'-':>14}")
        )
    if overlap:
        print(
            f"overlap: backward {overlap['backward_s'] * 1e3:.1f} ms, raw allreduce "
            f"{overlap['raw_allreduce_s'] * 1e3:.1f} ms, exposed "
            f"{overlap['exposed_s'] * 1e3:.2f} ms = "
            f"{overlap['exposed_fraction_of_raw'] * 100:.1f}% of the raw allreduce"
        )
    if args.json:
        worst = results[models[0]]
        print(
            json.dumps(
                {
                    "ranks": comm.size,
                    "reducer_busbw_gbs": worst["reducer_busbw_gbs"],
                    "flat_busbw_gbs": worst["flat_busbw_gbs"],
                    "naive_busbw_gbs": worst["naive_busbw_gbs"],
                    "models": results,
                    "overlap": overlap,
                }
            )
        )
    return 0
