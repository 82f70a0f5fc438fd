"""The slow-file-system part of `tools.bench train --slow-fs`: the mount, the index, the peers.

The peers are what users run today, measured on the same mount in the same run as hpcdl:
`cp -r` of the data set to local disk followed by hpcdl training from the copy, and PyTorch's
DataLoader reading the mount directly (tools.bench.torch_folder). Totals are wall seconds of
the whole command, start-up included, as a user would time them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from hpcdl.bench.scaling import child_env
from tools.bench.slowfs import SlowMount, mounted


def mount_data(stack: ExitStack, args: argparse.Namespace, root: str, scratch: Path) -> SlowMount:
    """Mount the data root behind the slow file system for the rest of the stack's life, and
    keep every index cache (this process's and the children's) off the mount, in scratch."""
    os.environ["XDG_CACHE_HOME"] = str(scratch / "cache")
    (scratch / "pfs").mkdir()
    return stack.enter_context(mounted(Path(root), scratch / "pfs", args.slow_fs_options))


def index_cost(pfs: SlowMount) -> dict[str, Any]:
    """Build the mounted data set's index once (cached for every later run); seconds and opens."""
    from hpcdl.data.augment import Augment  # noqa: PLC0415
    from hpcdl.data.batch import output_shape  # noqa: PLC0415
    from hpcdl.data.imagefolder import ImageFolderDataset  # noqa: PLC0415

    before = _settled_stats(pfs)["opens"]
    ds = ImageFolderDataset(pfs.mountpoint)
    opens = _settled_stats(pfs)["opens"] - before
    latency_s = pfs_latency_s(pfs)
    return {
        "files": len(ds),
        "seconds": ds.index_seconds,
        "opens": opens,
        "goal_seconds": len(ds) * latency_s / 16,
        "sample_shape": list(output_shape(ds, Augment())),  # what hpcdl.train yields: no --augment
        "bytes": int(ds.files.sizes.sum()),
    }


def pfs_latency_s(pfs: SlowMount) -> float:
    return pfs.options.latency_ms / 1000.0


def _settled_stats(pfs: SlowMount) -> dict[str, Any]:
    time.sleep(0.5)  # the server writes its counters every 0.2 s
    return pfs.stats()


def copy_then_train(args: argparse.Namespace, pfs: SlowMount, scratch: Path, train) -> dict:
    """`cp -r` the mounted data set to local disk, then `train(local_root)` -> (run dict, wall)."""
    local = scratch / "cp-copy"
    t0 = time.perf_counter()
    subprocess.run(["cp", "-r", str(pfs.mountpoint), str(local)], check=True)
    copy_s = time.perf_counter() - t0
    result, wall = train(str(local))
    return {"copy_s": copy_s, "train_s": wall, "total_s": copy_s + wall, "run": result}


def torch_dataloader(args: argparse.Namespace, pfs: SlowMount, crop: list[int]) -> dict | None:
    """PyTorch's DataLoader reading the mount directly; None (and a note) without torch."""
    cmd = [sys.executable, "-m", "tools.bench.torch_folder", "--data", str(pfs.mountpoint),
           "--workers", str(args.workers), "--batch-size", str(args.batch_size),
           "--epochs", str(args.epochs), "--crop", f"{crop[0]},{crop[1]}", "--json"]  # fmt: skip
    t0 = time.perf_counter()
    done = subprocess.run(
        cmd, env=child_env(1, "cpu"), capture_output=True, text=True, timeout=args.timeout
    )
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        print(
            f"tools.bench train: torch DataLoader skipped: {done.stderr.strip()}", file=sys.stderr
        )
        return None
    result = json.loads(done.stdout.splitlines()[-1])
    return result | {"total_s": wall}


def print_comparison(index: dict, runs: dict[str, dict], peers: dict, options) -> dict:
    """The table of hpcdl vs its peers on the slow file system, and the issue's ratios."""
    print(
        f"slow file system: {options.latency_ms:g} ms per open, {options.mbps:g} MB/s shared; "
        f"{index['files']} files, {index['bytes'] / 1e6:.1f} MB; index {index['seconds']:.2f} s "
        f"with {index['opens']} opens (goal <= files x latency / 16 = "
        f"{index['goal_seconds']:.2f} s)"
    )
    rows = []
    for mode in ("on", "off"):
        if mode in runs:
            r = runs[mode]
            rows.append((f"hpcdl, staging {mode}", r["wall_s"], r["epoch_seconds"]))
    if "cp" in peers:
        c = peers["cp"]
        label = f"cp -r ({c['copy_s']:.1f} s), then hpcdl"
        rows.append((label, c["total_s"], c["run"]["epoch_seconds"]))
    if peers.get("torch"):
        t = peers["torch"]
        rows.append((f"torch {t['torch']} DataLoader", t["total_s"], t["epoch_seconds"]))
    print(f"  {'run':<34} {'total s':>8} {'epoch 1 s':>9} {'later s':>8}")
    for label, total, epochs in rows:
        later = f"{sum(epochs[1:]) / len(epochs[1:]):.2f}" if len(epochs) > 1 else "n/a"
        print(f"  {label:<34} {total:>8.2f} {epochs[0]:>9.2f} {later:>8}")
    ratios = {}
    if "on" in runs and peers.get("torch"):
        ratios["staged total / torch total (goal <= 0.5)"] = (
            runs["on"]["wall_s"] / peers["torch"]["total_s"]
        )
    if "on" in runs and "off" in runs and len(runs["on"]["epoch_seconds"]) > 1:
        later = runs["on"]["epoch_seconds"][1:]
        ratios["unstaged epoch 1 / staged later epoch (goal >= 5)"] = runs["off"]["epoch_seconds"][
            0
        ] / (sum(later) / len(later))
    ratios["index / (files x latency / 16) (goal <= 1)"] = index["seconds"] / max(
        index["goal_seconds"], 1e-9
    )
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}")
    return ratios
