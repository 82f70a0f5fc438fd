"""`python -m tools.bench train`: `bench train`'s harness modes (slow FS, vs PyTorch, hpcdl.torch).

It takes every option of `python -m hpcdl.bench train` (hpcdl/bench/train.py, whose pieces it
calls: the data, the hpcdl.train runs, the summaries) and one of three modes:

`--slow-fs MS,MBPS` (e.g. 5,200) puts the training data behind the slow read-only FUSE file
system of tools.bench.slowfs (MS per open, MBPS shared), which every reader pays for, and adds
the peers users run today, in the same run and on the same mount: `cp -r` of the data to local
disk followed by training from the copy, and PyTorch's DataLoader reading the mount directly
(tools.bench.torch_folder: same workers, batch and per-sample work; skipped without torch). The
index is built once, timed, and cached off the mount, so no run pays for it again; the
load-alone measurement is skipped (it would read the slow file system once more).

`--vs-torch` runs hpcdl.train (staging off) and PyTorch DDP (gloo) + DataLoader
(tools.bench.torch_ddp) on the same data, augmentation, model, per-rank batch, workers and
ranks, alternated `--rounds` times, and prints the steady-state images/s of each (epochs after
the first) and their ratio; its defaults are issue 12's setup (cnn, 2 ranks, batch 64, 1
worker, synthetic HDF5 32x32, crop4+flip).

`--torch-loader` runs one PyTorch DDP script (examples/torch_ddp.py) with torch's DataLoader
and with hpcdl.torch, alternated, on local data and behind `--slow-fs`
(tools.bench.torch_loader).

`--torch-engine` runs hpcdl.train with a torch model (the torch engine) and torchrun + DDP +
DataLoader on the same model, data, crops, batch, workers, ranks and seed, alternated, on local
data and behind `--slow-fs` (tools.bench.torch_engine).
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from hpcdl import metrics_file
from hpcdl.backend import gpu_available
from hpcdl.bench import train as user_bench
from hpcdl.bench.scaling import NO_GPU
from hpcdl.data.augment import parse_augment
from tools.bench import peers as peers_
from tools.bench import torch_engine, torch_loader, vs_torch
from tools.bench.slowfs import SlowFSOptions

PROG = "python -m tools.bench train"
# --vs-torch's defaults: the setup of issue 12 (2 ranks, cnn, batch 64, HDF5 32x32, crop4+flip)
VS_TORCH_DEFAULTS = dict(
    model="cnn", ranks=2, batch_size=64, workers=1, format="h5", augment="crop4+flip",
    synthetic=8192, staging="off",
)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    ap = user_bench.build_parser(PROG)
    ap.description = __doc__.split("\n")[0]
    ap.add_argument(
        "--slow-fs",
        help="MS,MBPS: data behind the slow FUSE file system (milliseconds per open, shared "
        "MB/s), and the peers measured too",
    )
    ap.add_argument(
        "--vs-torch",
        action="store_true",
        help="instead: hpcdl.train against PyTorch DDP (gloo) + DataLoader (tools.bench."
        "torch_ddp), same model, data, augmentation, batch, workers and ranks, CPU; steady-"
        "state images/s and their ratio. Defaults then: cnn, 2 ranks, batch 64, 1 worker, "
        "synthetic HDF5 32x32 (8192 images), crop4+flip. Needs torch",
    )
    ap.add_argument(
        "--torch-loader",
        action="store_true",
        help="instead: one PyTorch DDP script (examples/torch_ddp.py) with torch's DataLoader "
        "and with hpcdl.torch, alternated: images/s on local data, and the total time of "
        "--epochs epochs behind --slow-fs (DataLoader reading it, hpcdl.torch staging from it; "
        "goal <= 0.5x). Defaults then: 6000 synthetic 32x32 JPEGs, --slow-fs 5,200, 3 epochs, "
        "2 workers, batch 32, 1 rank. Needs torch (tools.bench.torch_loader)",
    )
    ap.add_argument(
        "--torch-engine",
        action="store_true",
        help="instead: hpcdl.train with a torch model (--model: a torch.nn.Module builder) and "
        "torchrun + DDP (gloo) + DataLoader, alternated, on local data (images/s, goal >= 1.0x) "
        "and behind --slow-fs (total time of --epochs epochs, goal <= 0.5x). Defaults then: "
        "hpcdl.bench.torch_models:resnet18, 2 ranks, batch 32, 2 workers, 1024 synthetic 72x72 "
        "JPEGs, rcrop64+flip, --slow-fs 5,200, 3 epochs. Needs torch (tools.bench.torch_engine)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="--vs-torch, --torch-loader, --torch-engine: runs of each side, alternated",
    )
    return ap


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = build_parser()
    if "--vs-torch" in argv:
        ap.set_defaults(**VS_TORCH_DEFAULTS)
    if "--torch-loader" in argv:
        ap.set_defaults(**torch_loader.DEFAULTS)
    if "--torch-engine" in argv:
        ap.set_defaults(**torch_engine.DEFAULTS)
    args = user_bench.check_args(ap, ap.parse_args(argv))
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    if args.slow_fs:
        try:
            latency_ms, mbps = (float(v) for v in args.slow_fs.split(","))
        except ValueError:
            ap.error(f"--slow-fs takes MS,MBPS (e.g. 5,200), got {args.slow_fs!r}")
        args.slow_fs_options = SlowFSOptions(latency_ms, mbps)
    if args.vs_torch + args.torch_loader + args.torch_engine > 1:
        ap.error("--vs-torch, --torch-loader and --torch-engine are three benchmarks: give one")
    if not (args.slow_fs or args.vs_torch or args.torch_loader or args.torch_engine):
        ap.error("give --slow-fs MS,MBPS, --vs-torch or --torch-loader (the plain staging on vs "
                 "off runs are `python -m hpcdl.bench train`)")  # fmt: skip
    if (args.torch_loader or args.torch_engine) and not args.slow_fs:
        ap.error("--torch-loader and --torch-engine measure behind the slow file system too: "
                 "give --slow-fs MS,MBPS")  # fmt: skip
    if args.torch_engine and args.device != "cpu":
        ap.error("--torch-engine compares on CPU (the GPU row is scripts/gpu-check.sh's)")
    if args.vs_torch:
        try:
            aug = parse_augment(args.augment)
        except ValueError as exc:
            ap.error(str(exc))
        if aug.crop or aug.rrc or args.device != "cpu" or args.slow_fs:
            ap.error("--vs-torch compares on CPU, without --slow-fs, with cropP and flip only")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.device == "gpu" and not gpu_available():
        print(NO_GPU, file=sys.stderr)
        return 2
    try:
        if args.vs_torch:
            return vs_torch.compare(args, user_bench.run_training, user_bench.ensure_data)
        if args.torch_loader:
            return torch_loader.compare(args, user_bench.ensure_data)
        if args.torch_engine:
            return torch_engine.compare(args, user_bench.run_training, user_bench.ensure_data)
        data = (user_bench.ensure_data(args)[0], args.val_data)  # validation is not the point
    except user_bench.CacheError as exc:
        print(f"tools.bench train: {exc}", file=sys.stderr)
        return 2
    print(
        f"tools.bench train: {args.model}, {args.ranks} rank(s) x batch {args.batch_size}, "
        f"{args.epochs} epoch(s), {args.workers} worker(s)/rank, data {data[0]}, "
        f"slow file system: {args.slow_fs}",
        flush=True,
    )
    try:
        results, peers = slow_fs_runs(args, data)
    except (
        RuntimeError,
        FileNotFoundError,
        subprocess.TimeoutExpired,
        metrics_file.ReportError,
    ) as exc:
        print(f"tools.bench train: {exc}", file=sys.stderr)
        return 1
    ratios = user_bench.compare(results["off"], results["on"]) if len(results) == 2 else {}
    user_bench.print_results(results, ratios)
    peers["ratios"] = peers_.print_comparison(peers["index"], results, peers, args.slow_fs_options)
    if args.json:
        skip = ("json", "measure_load", "slow_fs_options")
        config = {k: v for k, v in vars(args).items() if k not in skip}
        print(json.dumps({"config": config, "data": data, "runs": results, "ratios": ratios,
                          "slow_fs": peers}))  # fmt: skip
    return 0


def slow_fs_runs(args: argparse.Namespace, data: tuple[str, str | None]) -> tuple[dict, dict]:
    """hpcdl.train per staging mode on the mounted data, then the peers on the same mount."""
    keep = Path(args.keep_metrics) if args.keep_metrics else None
    peers: dict[str, Any] = {}
    with ExitStack() as stack:
        scratch = Path(tempfile.mkdtemp(prefix="hpcdl-bench-train-"))
        stack.callback(shutil.rmtree, scratch, ignore_errors=True)
        pfs = peers_.mount_data(stack, args, data[0], scratch)
        data = (str(pfs.mountpoint), data[1])
        peers["index"] = peers_.index_cost(pfs)
        results, _ = user_bench.run_modes(args, data, keep or scratch, load_alone=False)
        train_local = functools.partial(_local_run, args, scratch=scratch)
        peers["cp"] = peers_.copy_then_train(args, pfs, scratch, train_local)
        peers["torch"] = peers_.torch_dataloader(args, pfs, peers["index"]["sample_shape"][1:])
    return results, peers


def _local_run(args: argparse.Namespace, root: str, scratch: Path) -> tuple[dict, float]:
    """hpcdl.train without staging from a local copy (the `cp -r` peer); (summary, wall s)."""
    run, wall = user_bench.run_training(args, (root, None), False, scratch / "train-cp.jsonl")
    return user_bench.summarise(run, None, wall), wall


if __name__ == "__main__":
    sys.exit(main())
