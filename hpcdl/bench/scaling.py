"""`python -m hpcdl.bench scaling`: images/s vs batch size and rank count, fitted by b / v0 + t.

For each rank count R the benchmark launches `mpirun -np R python -m hpcdl.bench._steps`, which
times training steps (random data, bucketed gradient allreduce, SGD) at each per-rank batch
size. Per R it fits seconds per step = B / v0 + t on the GLOBAL batch B = R x per-rank batch,
so v0 is the whole job's ideal images/s (comparable across R: twice the ranks should give about
twice the v0) and t the fixed seconds per step. It prints measured and fitted images/s, the
global batch that reaches 90% of v0 (b90) and, with --plot, measured points and fitted curves.
With --json the last line is one JSON object holding `fits` and `points`. Definitions and how to
read them: docs/report.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from typing import Any

from hpcdl.backend import cpu_threads_hint, gpu_available
from hpcdl.bench.launch import child_env, mpirun_command
from hpcdl.clustermodel import speed
from hpcdl.figure_file import FigureFileError, checked_or_exit, save_figure
from hpcdl.helpformat import HelpFormatter

FRACTION = 0.9
MODELS = ("mlp", "cnn", "resnet20", "resnet18", "resnet50")  # hpcdl.nn.MODELS; checked in tests
NO_GPU = (
    "hpcdl.bench: --device gpu needs CuPy and a visible NVIDIA GPU on this node; "
    "install the 'gpu' extra (pip install 'hpcdl[gpu]') or use --device cpu"
)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m hpcdl.bench scaling",
        description=__doc__.split("\n")[0],
        allow_abbrev=False,
        formatter_class=HelpFormatter,
    )
    ap.add_argument("--model", default="cnn", choices=MODELS, help="network to time")
    ap.add_argument("--input-shape", default="3,32,32", help="C,H,W of one synthetic sample")
    ap.add_argument("--classes", type=int, default=10, help="output classes of the network")
    ap.add_argument(
        "--batch-sizes",
        default="8,16,32,64",
        help="per-rank batch sizes in samples, comma-separated",
    )
    ap.add_argument("--ranks", default="1,2", help="rank counts, comma-separated")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per batch size and round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds over all batch sizes")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per batch size")
    ap.add_argument("--device", default="cpu", choices=("cpu", "gpu"), help="cpu or gpu (CuPy)")
    ap.add_argument("--bucket-mb", type=float, default=25.0, help="gradient bucket size in MiB")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per mpirun")
    ap.add_argument(
        "--plot",
        help="write measured points and fitted curves to this figure: png, pdf, svg, ... "
        "(default: none)",
    )
    ap.add_argument("--json", action="store_true", help="last line: one JSON object")
    return ap


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        args.shape = tuple(int(v) for v in args.input_shape.split(","))
        args.batches = sorted({int(v) for v in args.batch_sizes.split(",")})
        args.rank_counts = sorted({int(v) for v in args.ranks.split(",")})
    except ValueError:
        ap.error("--input-shape, --batch-sizes and --ranks take comma-separated integers")
    if len(args.shape) != 3:
        ap.error(f"--input-shape must be C,H,W (three integers), got {args.input_shape!r}")
    if len(args.batches) < 2 or min(args.batches) < 1:
        ap.error(f"--batch-sizes needs two or more positive sizes to fit, got {args.batch_sizes}")
    if min(args.rank_counts) < 1 or min(args.steps, args.rounds) < 1 or args.warmup < 0:
        ap.error("--ranks, --steps and --rounds must be >= 1, --warmup >= 0")
    checked_or_exit(ap, args.plot, "--plot")  # before the measurement, not after it
    return args


def measure(args: argparse.Namespace, ranks: int) -> dict[str, Any]:
    """Run the step worker under mpirun; return its JSON record (rank 0's last stdout line)."""
    cmd = mpirun_command(ranks) + [
        sys.executable, "-m", "hpcdl.bench._steps",
        "--model", args.model, "--input-shape", args.input_shape,
        "--classes", str(args.classes), "--batch-sizes", ",".join(map(str, args.batches)),
        "--steps", str(args.steps), "--rounds", str(args.rounds), "--warmup", str(args.warmup),
        "--device", args.device, "--bucket-mb", str(args.bucket_mb),
    ]  # fmt: skip
    done = subprocess.run(
        cmd, env=child_env(ranks, args.device), capture_output=True, text=True,
        timeout=args.timeout,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-15:]
        raise RuntimeError(
            f"{' '.join(cmd[:3])} ... exited with {done.returncode} without a result:\n"
            + "\n".join(tail)
        )
    return json.loads(lines[-1])


def analyse(records: list[dict[str, Any]]) -> tuple[list[dict], list[dict]]:
    """Fit each rank count on global batch; return (fits, points) as JSON-able dicts."""
    fits, points = [], []
    for rec in records:
        ranks = rec["ranks"]
        global_b = [ranks * p["batch"] for p in rec["points"]]
        seconds = [p["seconds_per_step"] for p in rec["points"]]
        try:
            fit = speed.fit(global_b, seconds)
        except speed.ScalingFitError as exc:
            fits.append({"ranks": ranks, "error": str(exc)})
            fit = None
        else:
            b90 = fit.batch_for_fraction(FRACTION)
            fits.append(
                {"ranks": ranks, "v0": fit.v0, "t": fit.t, "r2": fit.r2, "b90": b90,
                 "b90_per_rank": b90 / ranks, "separable": fit.separable, "note": fit.note}
            )  # fmt: skip
        for p, b, s in zip(rec["points"], global_b, seconds, strict=True):
            points.append(
                {"ranks": ranks, "batch": p["batch"], "global_batch": b, "seconds_per_step": s,
                 "images_per_s": b / s,
                 "images_per_s_fit": float(fit.speed(b)) if fit else None}
            )  # fmt: skip
    return fits, points


def print_table(fits: list[dict], points: list[dict]) -> None:
    print(f"{'ranks':>5} {'batch/rank':>10} {'global':>7} {'s/step':>9} {'img/s':>9} {'fit':>9}")
    for p in points:
        fitted = "n/a" if p["images_per_s_fit"] is None else f"{p['images_per_s_fit']:.1f}"
        print(
            f"{p['ranks']:>5} {p['batch']:>10} {p['global_batch']:>7} "
            f"{p['seconds_per_step']:>9.4f} {p['images_per_s']:>9.1f} {fitted:>9}"
        )
    base = next((f for f in fits if "v0" in f), None)
    for f in fits:
        if "error" in f:
            print(f"ranks {f['ranks']}: no fit: {f['error']}")
            continue
        ratio = f" ({f['v0'] / base['v0']:.2f}x v0 of {base['ranks']} rank(s))" if base else ""
        print(
            f"ranks {f['ranks']}: v0 = {f['v0']:.1f} images/s{ratio}, t = {f['t'] * 1e3:.2f} ms, "
            f"r2 = {f['r2']:.3f}; {FRACTION:.0%} of v0 needs a global batch of {f['b90']:.0f} "
            f"({f['b90_per_rank']:.0f} per rank)"
        )
        if f["note"]:
            print(f"  {f['note']}")
        if f["r2"] < 0.9:
            print(
                f"  warning: r2 {f['r2']:.2f}, t {f['t'] * 1e3:.2f} ms: the timings do not follow "
                "b / v0 + t well (other load on the machine? too few --steps?); check the plot"
            )


def plot(path: str, fits: list[dict], points: list[dict], title: str) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(7, 4.5), layout="constrained")
    for i, f in enumerate(fits):
        mine = [p for p in points if p["ranks"] == f["ranks"]]
        xs = [p["global_batch"] for p in mine]
        ax.plot(xs, [p["images_per_s"] for p in mine], "o", color=f"C{i}")
        label = f"{f['ranks']} rank(s)"
        if "v0" in f:
            grid = np.geomspace(min(xs) / 2, max(xs, default=1) * 4, 200)
            label += f": v0 {f['v0']:.0f} img/s, t {f['t'] * 1e3:.1f} ms, r2 {f['r2']:.2f}"
            ax.plot(grid, speed.speed(grid, f["v0"], f["t"]), "-", color=f"C{i}")
            ax.axhline(f["v0"], color=f"C{i}", ls=":", lw=0.8)
            if f["b90"] > 0:
                ax.plot([f["b90"]], [FRACTION * f["v0"]], "x", color=f"C{i}", markersize=9)
        ax.plot([], [], "o-", color=f"C{i}", label=label)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="global batch (images per step)", ylabel="images/s (whole job)", title=title)
    ax.text(0.01, 0.02, f"x: {FRACTION:.0%} of v0; dotted: v0", transform=ax.transAxes,
            fontsize="small")  # fmt: skip
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize="small")
    save_figure(fig, path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.device == "gpu" and not gpu_available():
        print(NO_GPU, file=sys.stderr)
        return 2
    machine = f"{platform.node()}, {cpu_threads_hint()} cores, {args.device}"
    print(
        f"hpcdl.bench scaling: {args.model} {args.input_shape}, per-rank batches {args.batches}, "
        f"ranks {args.rank_counts}, {args.rounds} x {args.steps} timed steps each ({machine})",
        flush=True,
    )
    records = []
    for ranks in args.rank_counts:
        try:
            records.append(measure(args, ranks))
        except (FileNotFoundError, RuntimeError, subprocess.TimeoutExpired) as exc:
            print(f"hpcdl.bench scaling: {ranks} rank(s): {exc}", file=sys.stderr)
            return 1
    fits, points = analyse(records)
    print_table(fits, points)
    if args.plot:
        try:
            plot(args.plot, fits, points, f"{args.model} {args.input_shape} on {machine}")
        except FigureFileError as exc:
            print(f"hpcdl.bench scaling: error: {exc}", file=sys.stderr)
            return 1
        print(f"wrote {args.plot}")
    if args.json:
        print(
            json.dumps(
                {
                    "model": args.model,
                    "input_shape": args.shape,
                    "device": args.device,
                    "steps": args.steps,
                    "machine": machine,
                    "fraction": FRACTION,
                    "fits": fits,
                    "points": points,
                }
            )  # fmt: skip
        )
    return 1 if any("error" in f for f in fits) else 0


if __name__ == "__main__":
    sys.exit(main())
