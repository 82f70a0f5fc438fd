"""Worker of `hpcdl.bench scaling`: time data-parallel training steps at each batch size.

Run under mpirun by hpcdl.bench.scaling (not by users). Every rank builds the same model on
random data, so loading is excluded: a step is forward + loss + backward with the bucketed
gradient allreduce (when there is more than one rank) + SGD update: hpcdl.nn.step.train_step, the
step hpcdl.train runs. Rank 0
prints one JSON line: per batch size, the median and mean over the timed steps (`--rounds`
rounds of `--steps` each, batch sizes interleaved) of the slowest rank's step time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np

from hpcdl import backend, nn
from hpcdl.bench.timing import slowest_per_round
from hpcdl.comm import cuda_aware
from hpcdl.comm.reducer import GradientReducer
from hpcdl.comm.world import init_world
from hpcdl.helpformat import HelpFormatter
from hpcdl.nn.step import StepParts, train_step


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m hpcdl.bench._steps",
        description="the MPI worker of hpcdl.bench scaling: times steps per batch size",
        allow_abbrev=False,
        formatter_class=HelpFormatter,
    )
    ap.add_argument("--model", required=True, choices=nn.MODELS, help="network to time")
    ap.add_argument("--input-shape", required=True, help="C,H,W of one synthetic sample")
    ap.add_argument("--classes", type=int, default=10, help="output classes of the network")
    ap.add_argument(
        "--batch-sizes", required=True, help="per-rank batch sizes in samples, comma-separated"
    )
    ap.add_argument("--steps", type=int, default=10, help="timed steps per batch size and round")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per batch size")
    ap.add_argument("--rounds", type=int, default=3, help="rounds over all batch sizes")
    ap.add_argument("--device", default="cpu", choices=("cpu", "gpu"), help="cpu or gpu (CuPy)")
    ap.add_argument("--bucket-mb", type=float, default=25.0, help="gradient bucket size in MiB")
    return ap


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    args.shape = tuple(int(v) for v in args.input_shape.split(","))
    args.batches = [int(v) for v in args.batch_sizes.split(",")]
    return args


LR = 0.001


def main(argv: list[str] | None = None) -> int:

    args = parse_args(argv)
    world = init_world()
    xp = backend.select(args.device, world.local_rank)
    host_staged = args.device == "gpu" and not cuda_aware.detect(world.comm, args.device).aware
    model = nn.build_model(args.model, args.shape, args.classes, seed=0, xp=xp)
    opt = nn.make_optimizer("sgd", model.params, model.grads, momentum=0.9)
    reducer = None
    if world.size > 1:
        reducer = GradientReducer(
            world.comm,
            model.grads_and_flags,
            args.bucket_mb,
            host_staged=host_staged,
            prescaled=True,
        )
    parts = StepParts(model, opt, xp, reducer)
    rng = np.random.default_rng(world.rank)

    data = {  # (B, C, H, W) float32 images and (B,) int64 labels per batch size
        b: (
            xp.asarray(rng.standard_normal((b, *args.shape)).astype(np.float32)),
            xp.asarray(rng.integers(0, args.classes, b)),
        )
        for b in args.batches
    }
    times = time_batches(parts, data, args, world.comm)
    points = []
    for batch, t in times.items():
        t = slowest_per_round(world.comm, t.reshape(-1))  # hpcdl.bench.timing
        points.append(
            {
                "batch": batch,
                "seconds_per_step": float(np.median(t)),
                "mean_seconds_per_step": float(t.mean()),
                "steps": int(t.size),
            }
        )
    if reducer:
        reducer.close()
    if world.is_root:
        record = {
            "ranks": world.size,
            "model": args.model,
            "device": args.device,
            "params": int(model.params.size),
            "points": points,
        }
        print(json.dumps(record), flush=True)
    return 0


def time_batches(parts: StepParts, data: dict, args: Any, comm: Any) -> dict[int, np.ndarray]:
    """Seconds of each timed step, (rounds, steps) per batch size. Rounds interleave the batch
    sizes, so a burst of other load on a shared machine lands on all of them, not on one."""
    times = {b: np.empty((args.rounds, args.steps)) for b in data}
    for r in range(args.rounds):
        for batch, (x, y) in data.items():
            for _ in range(args.warmup if r == 0 else 1):
                train_step(parts, x, y, LR)
            comm.Barrier()
            for i in range(args.steps):
                t0 = time.perf_counter()
                train_step(parts, x, y, LR)
                times[batch][r, i] = time.perf_counter() - t0
    return times


if __name__ == "__main__":
    sys.exit(main())
