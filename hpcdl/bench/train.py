"""`python -m hpcdl.bench train`: end-to-end images/s, step breakdown, overlap; staging on vs off.

Runs `mpirun -np R python -m hpcdl.train ... --metrics X.jsonl` once per staging mode (off
first: it is the baseline) and reads the metrics back. Overlap efficiency is
max(compute, load) / step time, from the source's rule that a pipelined step costs
max(T_forward+backward, T_minibatch_load): compute is the mean of t_compute + t_comm_exposed +
t_update, load the seconds per batch of the same loader (same workers, prefetch, data source)
measured alone before the run, and step time the mean t_step; 1.0 means loading is fully
hidden. With two or more epochs, the steady state (epochs after the first) is used.
Without --data a synthetic image folder (one PNG, or JPEG with --format jpg, per sample: the
case staging is for) is made once under the temp directory.

The harness modes, `--slow-fs MS,MBPS` (the data behind a slow FUSE file system, with the
peers users run today), `--vs-torch` (PyTorch DDP on the same job) and `--torch-loader`, are
`python -m tools.bench train` (tools/bench/train.py): it builds on this module, which imports
nothing from tools/ (docs/internals.md, "Benchmarks and harnesses").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hpcdl import metrics_file, report
from hpcdl.backend import gpu_available
from hpcdl.bench import synthetic
from hpcdl.bench.launch import child_env, mpirun_command
from hpcdl.bench.scaling import NO_GPU
from hpcdl.data import open_dataset
from hpcdl.figure_file import checked_or_exit
from hpcdl.helpformat import HelpFormatter

EMULATE_ENV = "HPCDL_STAGE_EMULATE_PFS"  # unit tests only: runs here never inherit it


def build_parser(prog: str = "python -m hpcdl.bench train") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.split("\n")[0],
        allow_abbrev=False,
        formatter_class=HelpFormatter,
    )
    ap.add_argument("--data", help="training data (default: a synthetic image folder)")
    ap.add_argument("--val-data", help="validation data (default: none, or the synthetic one)")
    ap.add_argument("--synthetic", type=int, default=1024, help="images made when --data is unset")
    ap.add_argument("--model", default="mlp", help="network to train (hpcdl.train --model)")
    ap.add_argument("--ranks", type=int, default=1, help="MPI ranks of each training run")
    ap.add_argument("--epochs", type=int, default=3, help="epochs of each training run")
    ap.add_argument("--batch-size", type=int, default=32, help="samples per step and rank")
    ap.add_argument("--workers", type=int, default=2, help="loader processes per rank")
    ap.add_argument("--prefetch", type=int, default=4, help="batch slots per rank")
    ap.add_argument(
        "--staging",
        default="both",
        choices=("on", "off", "both"),
        help="runs with --stage-dir, without, or one of each",
    )
    ap.add_argument("--stage-dir", help="node-local directory (default: a fresh temp directory)")
    ap.add_argument(
        "--format",
        default="png",
        choices=("png", "jpg", "h5"),
        help="synthetic data: an image folder of PNG or JPEG files, or HDF5 shards",
    )
    ap.add_argument("--augment", default="none", help="hpcdl.train --augment, e.g. crop4+flip")
    ap.add_argument("--image-size", type=int, default=32, help="synthetic images: S x S pixels")
    ap.add_argument("--device", default="cpu", choices=("cpu", "gpu"), help="cpu or gpu (CuPy)")
    ap.add_argument(
        "--keep-metrics", help="directory to keep the runs' metrics JSONL in (default: none)"
    )
    ap.add_argument(
        "--report",
        help="also draw hpcdl.report of the runs into this figure: png, pdf, svg, ... "
        "(default: none)",
    )
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per training run")
    ap.add_argument("--json", action="store_true", help="last line: one JSON object")
    ap.add_argument(
        "--measure-load",
        action="store_true",
        help="internal: time one pass of the loader over --data in this process, print JSON",
    )
    return ap


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """The checks every mode shares (ap.error, status 2, on the first that fails)."""
    for name in ("ranks", "epochs", "batch_size", "synthetic"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.workers < 0:
        ap.error("--workers must be >= 0")
    checked_or_exit(ap, args.report, "--report")  # before the runs, not after them
    return args


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = build_parser()
    return check_args(ap, ap.parse_args(argv))


# --- data ------------------------------------------------------------------------------------


class CacheError(RuntimeError):
    """The synthetic-data cache directory cannot be trusted; the message names it."""


def private_cache_dir() -> Path:
    """$TMPDIR/hpcdl-bench-data-<uid>, made mode 0700 for this user.

    The benchmark replaces an incomplete data set in it, so it must be a directory only this
    user can write: an existing path that is a symbolic link, another user's, or writable by
    others (all of which someone else could have planted in a shared /tmp) is refused."""
    root = Path(tempfile.gettempdir()) / f"hpcdl-bench-data-{os.getuid()}"
    try:
        root.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = os.lstat(root)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise CacheError(
            f"{root} is not a private directory of this user (a symbolic link, another user's, "
            "or writable by others), so the benchmark will not write or delete in it; remove it "
            "or point TMPDIR elsewhere"
        )
    return root


def ensure_data(args: argparse.Namespace) -> tuple[str, str | None]:
    """--data/--val-data, or a synthetic data set made once in private_cache_dir()."""
    if args.data:
        return args.data, args.val_data
    name = f"synthetic-{args.synthetic}"
    if (args.format, args.image_size) != ("png", 32):
        name += f"-{args.format}-{args.image_size}"
    base = private_cache_dir() / name
    if not (base / ".complete").exists():
        what = "HDF5 data set" if args.format == "h5" else "image folder"
        print(f"making a synthetic {what} of {args.synthetic} images in {base}", flush=True)
        work = base.with_name(f"{base.name}.tmp-{os.getpid()}")
        if args.format == "h5":
            synthetic.hdf5_dataset(work, args.synthetic, args.image_size)
        else:
            made = dict(side=args.image_size, fmt=args.format)
            synthetic.class_colour_folder(work / "train", args.synthetic, **made)
            synthetic.class_colour_folder(work / "val", max(10, args.synthetic // 4), **made)
        (work / ".complete").touch()
        shutil.rmtree(base, ignore_errors=True)
        work.rename(base)
    return str(base / "train"), str(base / "val")


# --- measurements ----------------------------------------------------------------------------


def measure_load_here(args: argparse.Namespace) -> dict[str, float]:
    """Seconds per batch of rank 0's loader reading one epoch alone (first batch excluded)."""
    from hpcdl.data import Loader  # noqa: PLC0415
    from hpcdl.data.sampler import DistributedSampler  # noqa: PLC0415

    ds = open_dataset(args.data)
    batches = DistributedSampler(len(ds), world_size=args.ranks, rank=0).batches(0, args.batch_size)
    loader = Loader(ds, args.batch_size, workers=args.workers, prefetch=args.prefetch, seed=0)
    try:
        count, start = 0, 0.0
        for _ in loader.iterate(batches, 0, train=True):
            count += 1
            if count == 1:  # worker start-up is not part of the steady state
                start = time.perf_counter()
        seconds = time.perf_counter() - start
    finally:
        loader.close()
    return {"batches": count, "seconds_per_batch": seconds / max(1, count - 1)}


def measure_load(args: argparse.Namespace, data: str) -> float | None:
    """Run measure_load_here in a fresh process."""
    env = child_env(1, args.device)
    env.pop(EMULATE_ENV, None)
    cmd = [sys.executable, "-m", "hpcdl.bench", "train", "--measure-load", "--data", data,
           "--ranks", str(args.ranks), "--batch-size", str(args.batch_size),
           "--workers", str(args.workers), "--prefetch", str(args.prefetch)]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = done.stderr.strip().splitlines()[-3:]
        print(f"hpcdl.bench train: loader-alone measurement failed: {tail}", file=sys.stderr)
        return None
    return float(json.loads(lines[-1])["seconds_per_batch"])


def run_training(
    args: argparse.Namespace, data: tuple[str, str | None], staging: bool, metrics: Path
) -> tuple[metrics_file.Run, float]:
    """One `mpirun ... hpcdl.train` run; returns its parsed metrics and wall seconds."""
    metrics.unlink(missing_ok=True)  # the trainer appends
    cmd = mpirun_command(args.ranks) + [
        sys.executable, "-m", "hpcdl.train", "--data", data[0],
        "--model", args.model, "--epochs", str(args.epochs),
        "--batch-size", str(args.batch_size), "--workers", str(args.workers),
        "--prefetch", str(args.prefetch), "--device", args.device,
        "--augment", args.augment,
        "--metrics", str(metrics), "--metrics-every", "1", "--quiet",
    ]  # fmt: skip
    if data[1]:
        cmd += ["--val-data", data[1]]
    stage_dir = None
    if staging:
        stage_dir = args.stage_dir or tempfile.mkdtemp(prefix="hpcdl-bench-stage-")
        cmd += ["--stage-dir", stage_dir]
    env = child_env(args.ranks, args.device)
    env.pop(EMULATE_ENV, None)
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    finally:
        if stage_dir and not args.stage_dir:
            shutil.rmtree(stage_dir, ignore_errors=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
        raise RuntimeError(f"hpcdl.train exited with {done.returncode}:\n{tail}")
    return metrics_file.load_run(metrics), wall


def summarise(run: metrics_file.Run, load_s: float | None, wall: float) -> dict[str, Any]:
    """The figures of one run; step means over the steady state (epochs after the first)."""
    steady = [s for s in run.steps if s["epoch"] >= 1] or run.steps
    parts = metrics_file.mean_breakdown(steady)
    compute = parts["t_compute"] + parts["t_comm_exposed"] + parts["t_update"]
    epochs = sorted(run.epochs, key=lambda e: e["epoch"])
    seconds = [float(e["seconds"]) for e in epochs]
    overlap = None
    if load_s is not None and parts["t_step"] > 0:
        overlap = max(compute, load_s) / parts["t_step"]
    return {
        "images_per_s": metrics_file.images_per_s(run),
        "epoch_seconds": seconds,
        "epoch_images_per_s": [e.get("images_per_s") for e in epochs],
        "mean_step": parts,
        "compute_s": compute,
        "load_s": load_s,
        "overlap_efficiency": overlap,
        "staging_hit_rate": metrics_file.staging_hit_rate(run),
        "val_accuracy": metrics_file.val_accuracy(run),
        "wall_s": wall,
    }


def print_results(results: dict[str, dict[str, Any]], ratios: dict[str, float]) -> None:
    print(
        f"{'staging':>7} {'img/s':>8} {'epoch1 s':>8} {'later s':>8} {'data ms':>8} "
        f"{'comp ms':>8} {'comm ms':>8} {'upd ms':>7} {'load ms':>8} {'overlap':>7} {'hits':>6}"
    )
    for mode, r in results.items():
        later = r["epoch_seconds"][1:]
        p = r["mean_step"]

        def ms(v: float | None) -> str:
            return "n/a" if v is None else f"{v * 1e3:.1f}"

        hits = "n/a" if r["staging_hit_rate"] is None else f"{100 * r['staging_hit_rate']:.0f}%"
        overlap = "n/a" if r["overlap_efficiency"] is None else f"{r['overlap_efficiency']:.2f}"
        print(
            f"{mode:>7} {r['images_per_s'] or float('nan'):>8.1f} {r['epoch_seconds'][0]:>8.2f} "
            f"{(f'{sum(later) / len(later):.2f}' if later else 'n/a'):>8} "
            f"{ms(p['t_data']):>8} {ms(p['t_compute']):>8} {ms(p['t_comm_exposed']):>8} "
            f"{ms(p['t_update']):>7} {ms(r['load_s']):>8} {overlap:>7} {hits:>6}"
        )
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}x")


def compare(off: dict[str, Any], on: dict[str, Any]) -> dict[str, float]:
    """Staging on vs off: epoch-1 slowdown, later-epoch and whole-run speedups."""
    ratios = {
        "epoch 1 time, staging on / off": on["epoch_seconds"][0] / off["epoch_seconds"][0],
        "images/s, staging on / off": on["images_per_s"] / off["images_per_s"],
    }
    later_on, later_off = on["epoch_seconds"][1:], off["epoch_seconds"][1:]
    if later_on and later_off:
        ratios["later epochs speedup, off time / on time"] = sum(later_off) / sum(later_on)
    return ratios


def run_modes(
    args: argparse.Namespace, data: tuple[str, str | None], out: Path, load_alone: bool = True
) -> tuple:
    """hpcdl.train once per staging mode; (summaries by mode, metrics paths). load_alone=False
    skips the loader-alone measurement (on a slow file system it would read it once more)."""
    modes = {"both": ("off", "on"), "on": ("on",), "off": ("off",)}[args.staging]
    results: dict[str, dict[str, Any]] = {}
    paths = []
    for mode in modes:
        # Load alone, from what the run reads in steady state: staged runs read local copies.
        load_s = measure_load(args, data[0]) if load_alone else None
        metrics = out / f"train-staging-{mode}.jsonl"
        metrics.parent.mkdir(parents=True, exist_ok=True)
        run, wall = run_training(args, data, mode == "on", metrics)
        results[mode] = summarise(run, load_s, wall)
        paths.append(str(metrics))
    if args.report:
        labels = ",".join(f"staging {m}" for m in modes)
        report.main([*paths, "--out", args.report, "--labels", labels])
    return results, paths


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.measure_load:
        print(json.dumps(measure_load_here(args)), flush=True)
        return 0
    if args.device == "gpu" and not gpu_available():
        print(NO_GPU, file=sys.stderr)
        return 2
    try:
        data = ensure_data(args)
    except CacheError as exc:
        print(f"hpcdl.bench train: {exc}", file=sys.stderr)
        return 2
    print(
        f"hpcdl.bench train: {args.model}, {args.ranks} rank(s) x batch {args.batch_size}, "
        f"{args.epochs} epoch(s), {args.workers} worker(s)/rank, data {data[0]}",
        flush=True,
    )
    try:
        with tempfile.TemporaryDirectory(prefix="hpcdl-bench-train-") as scratch:
            keep = Path(args.keep_metrics) if args.keep_metrics else Path(scratch)
            results, _ = run_modes(args, data, keep)
    except (
        RuntimeError,
        FileNotFoundError,
        subprocess.TimeoutExpired,
        metrics_file.ReportError,
    ) as exc:
        print(f"hpcdl.bench train: {exc}", file=sys.stderr)
        return 1
    ratios = compare(results["off"], results["on"]) if len(results) == 2 else {}
    print_results(results, ratios)
    if args.json:
        config = {k: v for k, v in vars(args).items() if k not in ("json", "measure_load")}
        print(json.dumps({"config": config, "data": data, "runs": results, "ratios": ratios}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
