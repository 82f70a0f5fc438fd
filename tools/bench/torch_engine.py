"""`python -m tools.bench train --torch-engine`: hpcdl.train's torch engine against torchrun + DDP.

The same torch model (`--model`, a builder of a torch.nn.Module: by default
hpcdl.bench.torch_models:resnet18, torchvision's resnet18 written out, as the CPU-only torch
wheel cannot import torchvision), data, augmentation (the crops), per-rank batch, workers,
ranks and seed, alternated `--rounds` times:
- hpcdl: `mpirun -np R python -m hpcdl.train --model SPEC` (hpcdl/torch_engine: hpcdl's
  loader, its reducer over MPI), mpirun's default binding as users run it;
- torch: `torchrun --nproc-per-node R examples/torch_ddp.py --dataloader --model SPEC`
  (DistributedDataParallel, gloo, torch's DataLoader in hpcdl's sample order and with hpcdl's
  per-sample work: hpcdl.torch.HpcdlSamples), every core for its workers (as `--bind-to none`).
Both get child_env's OMP_NUM_THREADS (the cores / the ranks), which torchrun keeps.
Two settings, as tools.bench.torch_loader: local data read in place by both (steady-state
images/s, the epochs after the first), and the data behind the slow FUSE file system
(`--slow-fs MS,MBPS`), DataLoader reading the mount on every epoch and hpcdl.train staging from
it (`--stage-dir`, fresh per run): wall seconds of the whole command for `--epochs` epochs,
start-up included. The index is built once before and cached off the mount. The 1-minute load
average before each run is kept: this is a timing on a shared machine.
Defaults: issue 61's goal (2 ranks, resnet18, 1,024 synthetic 72x72 JPEGs in random 64x64
crops with flips, batch 32, 2 workers, 3 epochs, 5 ms per open and 200 MB/s).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from hpcdl import metrics_file
from hpcdl.bench.launch import child_env
from tools.bench import peers, torch_ddp, vs_torch
from tools.bench.torch_loader import EXAMPLE, example_record, scratch_dir, start_comparison

DEFAULTS = dict(
    model="hpcdl.bench.torch_models:resnet18", synthetic=1024, format="jpg", image_size=72,
    augment="rcrop64+flip", slow_fs="5,200", epochs=3, workers=2, batch_size=32, ranks=2,
    staging="on",
)  # fmt: skip
SEED = 0  # hpcdl.train's default --seed, which bench train's runs keep
GOALS = {"local images/s (steady)": 1.0, "slow FS total s": 0.5}  # hpcdl / torch, issue 61


def run_torch(args: argparse.Namespace, data: str) -> dict[str, Any]:
    """One `torchrun ... examples/torch_ddp.py --dataloader` run: rank 0's record, its wall
    seconds and steady-state images/s."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.ranks),
        "--master-addr", "127.0.0.1", "--master-port", str(torch_ddp.free_port()),
        str(EXAMPLE), "--dataloader", "--data", data, "--model", args.model,
        "--epochs", str(args.epochs), "--batch-size", str(args.batch_size),
        "--workers", str(args.workers), "--augment", args.augment, "--seed", str(SEED),
    ]  # fmt: skip
    env = child_env(args.ranks, "cpu") | {"GLOO_SOCKET_IFNAME": "lo"}
    record, wall = example_record(cmd, env, args.timeout, "torchrun examples/torch_ddp.py")
    seconds, images = record["epoch_seconds"], record["images_per_epoch"]
    return {
        "images_per_s": torch_ddp.steady_images_per_s(seconds, images),
        "epoch_seconds": seconds,
        "wall_s": wall,
    }


def run_hpcdl(
    args: argparse.Namespace, data: str, stage: bool, metrics: Path, run_training: Callable
) -> dict[str, Any]:
    """One `mpirun ... hpcdl.train --model SPEC` run (hpcdl.bench.train.run_training)."""
    run, wall = run_training(args, (data, None), stage, metrics)
    epochs = sorted(run.epochs, key=lambda e: e["epoch"])
    return {
        "images_per_s": vs_torch.hpcdl_steady_images_per_s(run),
        "epoch_seconds": [float(e["seconds"]) for e in epochs],
        "wall_s": wall,
    }


def alternate(
    args: argparse.Namespace, data: str, hpcdl_run: Callable[[int], dict], label: str
) -> dict[str, list[dict]]:
    """torch, then hpcdl, --rounds times: {"torch": [...], "hpcdl": [...]}, each with the
    load average before it."""
    runs: dict[str, list[dict]] = {"torch": [], "hpcdl": []}
    for r in range(args.rounds):
        load = os.getloadavg()[0]
        runs["torch"].append(run_torch(args, data) | {"load": load})
        load = os.getloadavg()[0]
        runs["hpcdl"].append(hpcdl_run(r) | {"load": load})
        t, h = runs["torch"][-1], runs["hpcdl"][-1]
        print(f"  {label} round {r + 1}: torchrun+DDP+DataLoader {t['wall_s']:.1f} s, "
              f"{t['images_per_s']:.1f} images/s (load {t['load']:.1f}); hpcdl.train "
              f"{h['wall_s']:.1f} s, {h['images_per_s']:.1f} images/s (load {h['load']:.1f})",
              flush=True)  # fmt: skip
    return runs


def compare(args: argparse.Namespace, run_training: Callable, ensure_data: Callable) -> int:
    """Both settings (module notes); prints the table and the ratios, JSON with --json."""
    data = start_comparison(args, ensure_data, "--torch-engine", f"--model {args.model}",
                            f"--augment {args.augment}, ")  # fmt: skip
    if data is None:
        return 2
    try:
        with ExitStack() as stack:
            scratch = scratch_dir(stack, "torch-engine")

            def hpcdl_run(where: str, stage: bool) -> Callable[[int], dict]:
                def one(r: int) -> dict:
                    args.stage_dir = str(scratch / f"stage-{r}") if stage else None
                    metrics = scratch / f"{'slow' if stage else 'local'}-{r}.jsonl"
                    return run_hpcdl(args, where, stage, metrics, run_training)

                return one

            local = alternate(args, data, hpcdl_run(data, False), "local")
            pfs = peers.mount_data(stack, args, data, scratch)
            index = peers.index_cost(pfs)
            mount = str(pfs.mountpoint)
            slow = alternate(args, mount, hpcdl_run(mount, True), f"slow FS {args.slow_fs}")
    except (RuntimeError, subprocess.TimeoutExpired, metrics_file.ReportError) as exc:
        print(f"tools.bench train: {exc}", file=sys.stderr)
        return 1
    ratios = print_table(local, slow)
    if args.json:
        keep = ("model", "ranks", "batch_size", "epochs", "workers", "augment", "slow_fs",
                "rounds", "image_size")  # fmt: skip
        config = {k: getattr(args, k) for k in keep} | {"seed": SEED}
        print(json.dumps({"config": config, "data": data, "local": local, "slow_fs": slow,
                          "index": index, "ratios": ratios, "goals": GOALS}))  # fmt: skip
    return 0


def print_table(local: dict, slow: dict) -> dict[str, float]:
    """Medians and ranges over the rounds, and hpcdl / torch for each row."""
    print(f"  {'':<26} {'torchrun+DDP':>22} {'hpcdl.train':>22} {'ratio':>6}")
    rows = {
        "local images/s (steady)": (local, "images_per_s"),
        "local total s": (local, "wall_s"),
        "slow FS total s": (slow, "wall_s"),
        "slow FS images/s (steady)": (slow, "images_per_s"),
    }
    ratios = {}
    for label, (runs, key) in rows.items():
        cells = []
        for side in ("torch", "hpcdl"):
            values = [r[key] for r in runs[side]]
            cells.append((statistics.median(values), min(values), max(values)))
        ratios[label] = cells[1][0] / cells[0][0]
        shown = [f"{m:.1f} ({lo:.1f}-{hi:.1f})" for m, lo, hi in cells]
        print(f"  {label:<26} {shown[0]:>22} {shown[1]:>22} {ratios[label]:>6.2f}")
    for label, goal in GOALS.items():
        sign = ">=" if "images/s" in label else "<="
        print(f"{label}: hpcdl.train / torchrun+DDP+DataLoader {ratios[label]:.2f} "
              f"(goal {sign} {goal})")  # fmt: skip
    return ratios
