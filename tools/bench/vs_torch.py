"""`python -m tools.bench train --vs-torch`: hpcdl.train against PyTorch DDP + DataLoader.

Both run on the same data, augmentation, model, per-rank batch, workers and ranks, alternated
`--rounds` times; each reports steady-state images/s (the epochs after the first) and the run
prints their ratio. The PyTorch side is tools.bench.torch_ddp; torch is a benchmark-only
dependency, and without it this says so in one line and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from hpcdl import metrics_file
from hpcdl.data import open_dataset
from tools.bench import torch_ddp


def hpcdl_steady_images_per_s(run: metrics_file.Run) -> float:
    epochs = sorted(run.epochs, key=lambda e: e["epoch"])
    seconds = [float(e["seconds"]) for e in epochs]
    images = [e["images_per_s"] * s for e, s in zip(epochs, seconds)]
    return torch_ddp.steady_images_per_s(seconds, images)


def compare(args: argparse.Namespace, run_training: Callable, ensure_data: Callable) -> int:
    """hpcdl.train and PyTorch DDP, alternated --rounds times; prints images/s and the ratio.

    run_training and ensure_data are hpcdl.bench.train's (how it runs hpcdl.train and makes or
    finds the data)."""
    try:
        import torch  # noqa: F401, PLC0415
    except ImportError:
        print("tools.bench train: --vs-torch needs PyTorch, which is not installed "
              "(pip install torch)", file=sys.stderr)  # fmt: skip
        return 2
    data = ensure_data(args)[0]
    if open_dataset(data).kind != "hdf5":
        print(f"tools.bench train: --vs-torch reads HDF5 data and {data} is not; "
              "`python -m hpcdl.data convert` makes HDF5 from it", file=sys.stderr)  # fmt: skip
        return 2
    print(
        f"tools.bench train --vs-torch: {args.model}, {args.ranks} rank(s) x batch "
        f"{args.batch_size}, {args.epochs} epoch(s) (steady state: after the first), "
        f"{args.workers} worker(s)/rank, --augment {args.augment}, data {data}",
        flush=True,
    )
    ours: list[float] = []
    theirs: list[float] = []
    loads: list[list[float]] = []  # 1-minute load average before each run: [hpcdl, torch]
    try:
        with tempfile.TemporaryDirectory(prefix="hpcdl-bench-vs-torch-") as scratch:
            for r in range(args.rounds):
                loads_before = os.getloadavg()[0]
                run, _ = run_training(args, (data, None), False, Path(scratch) / f"{r}.jsonl")
                ours.append(hpcdl_steady_images_per_s(run))
                loads.append([loads_before, os.getloadavg()[0]])
                peer = torch_ddp.run(args, data)
                theirs.append(peer["images_per_s"])
                print(f"round {r + 1}: hpcdl {ours[-1]:.0f} images/s (load {loads[-1][0]:.1f}), "
                      f"torch {theirs[-1]:.0f} images/s (load {loads[-1][1]:.1f}, "
                      f"{peer['threads']} thread(s)/rank), ratio {ours[-1] / theirs[-1]:.2f}",
                      flush=True)  # fmt: skip
    except (RuntimeError, subprocess.TimeoutExpired, metrics_file.ReportError) as exc:
        print(f"tools.bench train: {exc}", file=sys.stderr)
        return 1
    ratio = statistics.median(ours) / statistics.median(theirs)
    print(f"median: hpcdl {statistics.median(ours):.0f} images/s, torch "
          f"{statistics.median(theirs):.0f} images/s, hpcdl/torch {ratio:.2f}")  # fmt: skip
    if args.json:
        keep = ("model", "ranks", "batch_size", "epochs", "workers", "prefetch", "augment")
        config = {k: getattr(args, k) for k in keep}
        result = {"config": config, "data": data, "hpcdl_images_per_s": ours,
                  "torch_images_per_s": theirs, "ratio": ratio, "load_average": loads}  # fmt: skip
        print(json.dumps(result))
    return 0
