"""`python -m tools.bench train --torch-loader`: one PyTorch DDP script, two data paths.

examples/torch_ddp.py (DDP; `--model linear`, one dense layer, so that the step costs next to
nothing and the input pipeline is what is measured, as issue 14's mlp) runs under `mpirun -np
R` with torch's DataLoader (`--dataloader`: hpcdl's sample order and per-sample decode, torch's
pipeline, reading the data in place) and with hpcdl.torch.Loader, alternated `--rounds` times
on the same data, workers, batch and ranks:
- on local data (hpcdl.torch reading in place): steady-state images/s, the epochs after the
  first;
- behind the slow FUSE file system (`--slow-fs MS,MBPS`, tools.bench.slowfs): DataLoader reading
  the mount on every epoch, hpcdl.torch staging from it (`--stage-dir`, a fresh directory each
  run); wall seconds of the whole command for `--epochs` epochs, start-up included. The image
  folder's index is built once before (tools.bench.peers.index_cost) and cached off the mount,
  so neither side pays for it.
Defaults: issue 14's setup (6,000 synthetic 32x32 JPEGs, 5 ms per open, 200 MB/s, 3 epochs,
2 workers, batch 32, 1 rank). The DataLoader runs get `--bind-to none`: mpirun binds one or two
ranks to a core each, and torch's workers would inherit that core where hpcdl.torch's get the
node's free ones (hpcdl.data.worker_cores); unbound, they get every core, as under torchrun.
Needs torch and the repository's examples/ directory.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from hpcdl.bench.launch import child_env, mpirun_command
from tools.bench import peers
from tools.bench.torch_ddp import steady_images_per_s

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "torch_ddp.py"
MODEL = ["--model", "linear"]
DEFAULTS = dict(
    synthetic=6000, format="jpg", image_size=32, slow_fs="5,200", epochs=3, workers=2,
    batch_size=32, ranks=1, staging="on",
)  # fmt: skip
GOAL = 0.5  # hpcdl.torch staged / DataLoader on the slow file system, total time


def run_script(args: argparse.Namespace, data: str, extra: list[str]) -> dict[str, Any]:
    """One `mpirun ... examples/torch_ddp.py` run: rank 0's JSON record plus wall seconds and
    steady-state images/s."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launch = mpirun_command(args.ranks)
    if "--dataloader" in extra:  # every core for torch's workers, as torchrun gives them
        launch += ["--bind-to", "none"]
    cmd = launch + [
        sys.executable, str(EXAMPLE), "--data", data, "--epochs", str(args.epochs),
        "--batch-size", str(args.batch_size), "--workers", str(args.workers),
        "--augment", args.augment, *MODEL, *extra,
    ]  # fmt: skip
    env = child_env(args.ranks, "cpu") | {"MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "lo"}
    record, wall = example_record(cmd, env, args.timeout, "examples/torch_ddp.py")
    record["images_per_s"] = steady_images_per_s(
        record["epoch_seconds"], record["images_per_epoch"]
    )
    return record | {"wall_s": wall}


def example_record(cmd: list[str], env: dict, timeout: float, what: str) -> tuple[dict, float]:
    """(rank 0's JSON record, wall seconds) of one examples/torch_ddp.py run, the last JSON
    line it prints; RuntimeError with the tail of its output where it fails."""
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - start
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
        raise RuntimeError(f"{what} exited with {done.returncode}:\n{tail}")
    return json.loads(lines[-1]), wall


def alternate(args: argparse.Namespace, data: str, hpcdl_flags: Callable[[int], list[str]]):
    """DataLoader, then hpcdl.torch, --rounds times: {"dataloader": [...], "hpcdl": [...]}."""
    runs: dict[str, list[dict]] = {"dataloader": [], "hpcdl": []}
    for r in range(args.rounds):
        runs["dataloader"].append(run_script(args, data, ["--dataloader"]))
        runs["hpcdl"].append(run_script(args, data, hpcdl_flags(r)))
        d, h = runs["dataloader"][-1], runs["hpcdl"][-1]
        print(f"  round {r + 1}: DataLoader {d['wall_s']:.1f} s, {d['images_per_s']:.0f} "
              f"images/s; hpcdl.torch {h['wall_s']:.1f} s, {h['images_per_s']:.0f} images/s",
              flush=True)  # fmt: skip
    return runs


def start_comparison(
    args: argparse.Namespace, ensure_data: Callable, flag: str, what: str, more: str = ""
) -> str | None:
    """The data a comparison with examples/torch_ddp.py runs on (flag: --torch-loader or
    --torch-engine), once its first line is printed (what and more: its own settings); None
    once it said in one line why it cannot run (no PyTorch, no example)."""
    try:
        import torch  # noqa: F401, PLC0415
    except ImportError:
        print(f"tools.bench train: {flag} needs PyTorch (pip install 'hpcdl[torch]')",
              file=sys.stderr)  # fmt: skip
        return None
    if not EXAMPLE.exists():
        print(f"tools.bench train: {flag} runs {EXAMPLE}, which is missing; run it "
              "from a checkout of the repository", file=sys.stderr)  # fmt: skip
        return None
    data = ensure_data(args)[0]
    print(f"tools.bench train {flag}: {what}, {args.ranks} rank(s) x batch {args.batch_size}, "
          f"{args.epochs} epoch(s), {args.workers} worker(s)/rank, {more}data {data}",
          flush=True)  # fmt: skip
    return data


def scratch_dir(stack: ExitStack, name: str) -> Path:
    """A temporary folder for a comparison's stage dirs and metrics, removed with stack."""
    scratch = Path(tempfile.mkdtemp(prefix=f"hpcdl-bench-{name}-"))
    stack.callback(shutil.rmtree, scratch, ignore_errors=True)
    return scratch


def compare(args: argparse.Namespace, ensure_data: Callable) -> int:
    """Both measurements (module notes); prints the table and the ratios."""
    data = start_comparison(args, ensure_data, "--torch-loader", "examples/torch_ddp.py")
    if data is None:
        return 2
    try:
        with ExitStack() as stack:
            scratch = scratch_dir(stack, "torch-loader")
            print("local data, read in place by both:", flush=True)
            local = alternate(args, data, lambda r: [])
            pfs = peers.mount_data(stack, args, data, scratch)
            index = peers.index_cost(pfs)
            print(f"slow file system {args.slow_fs}: DataLoader reads it, hpcdl.torch stages "
                  f"from it (index built once: {index['seconds']:.1f} s)", flush=True)  # fmt: skip
            slow = alternate(
                args, str(pfs.mountpoint), lambda r: ["--stage-dir", str(scratch / f"stage-{r}")]
            )
    except (RuntimeError, FileNotFoundError, subprocess.TimeoutExpired) as exc:
        print(f"tools.bench train: {exc}", file=sys.stderr)
        return 1
    ratios = print_table(local, slow)
    if args.json:
        keep = ("ranks", "batch_size", "epochs", "workers", "augment", "slow_fs", "rounds")
        config = {k: getattr(args, k) for k in keep}
        print(json.dumps({"config": config, "data": data, "local": local, "slow_fs": slow,
                          "index": index, "ratios": ratios}))  # fmt: skip
    return 0


def print_table(local: dict, slow: dict) -> dict[str, float]:
    """Medians over the rounds, and the two ratios."""

    def median(runs: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in runs)

    print(f"  {'':<26} {'DataLoader':>11} {'hpcdl.torch':>11} {'ratio':>6}")
    rows = {
        "local images/s (steady)": (local, "images_per_s"),
        "slow FS total s": (slow, "wall_s"),
        "slow FS images/s (steady)": (slow, "images_per_s"),
    }
    ratios = {}
    for label, (runs, key) in rows.items():
        theirs, ours = median(runs["dataloader"], key), median(runs["hpcdl"], key)
        ratios[label] = ours / theirs
        print(f"  {label:<26} {theirs:>11.1f} {ours:>11.1f} {ours / theirs:>6.2f}")
    print(f"slow FS: hpcdl.torch staged total / DataLoader total (goal <= {GOAL}): "
          f"{ratios['slow FS total s']:.2f}")  # fmt: skip
    print(f"local data: hpcdl.torch / DataLoader images/s: "
          f"{ratios['local images/s (steady)']:.2f}")  # fmt: skip
    return ratios
