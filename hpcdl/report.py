"""`python -m hpcdl.report METRICS.jsonl [MORE.jsonl ...] --out report.png`: where time goes.

Reads the metrics JSON lines of `hpcdl.train --metrics` (format: docs/internals.md) and draws,
for one run or several side by side: throughput over time, the mean step broken into data
wait / compute / exposed communication / update per epoch (stacked bars), and staging progress
against consumption when the run has `staging` events. A short text summary goes to stdout.
How to read it: docs/report.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STEP_FIELDS = ("epoch", "time", "t_data", "t_compute", "t_comm_exposed", "t_update", "t_step")
BREAKDOWN = (  # (field, legend label, colour)
    ("t_data", "data wait", "#4c72b0"),
    ("t_compute", "compute", "#55a868"),
    ("t_comm_exposed", "exposed comm", "#c44e52"),
    ("t_update", "update", "#8172b2"),
)
STAGING_FIELDS = ("time", "files_ready", "consumed_files")


class ReportError(Exception):
    """The metrics input cannot be reported on; the message names the file (and line)."""


@dataclass
class Run:
    """The events of one metrics file, grouped by kind."""

    path: Path
    label: str = ""
    start: dict[str, Any] | None = None
    steps: list[dict[str, Any]] = field(default_factory=list)
    epochs: list[dict[str, Any]] = field(default_factory=list)
    staging: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] | None = None

    @property
    def t0(self) -> float:
        """Wall-clock origin of the run's time axis (the start event, else the first step)."""
        if self.start and isinstance(self.start.get("time"), (int, float)):
            return float(self.start["time"])
        return min(float(s["time"]) for s in self.steps)

    @property
    def world_size(self) -> int | None:
        for source in (self.summary, self.start):
            if source and source.get("world_size") is not None:
                return int(source["world_size"])
        return None

    @property
    def global_batch(self) -> int | None:
        for source in (self.summary, self.start):
            if source and source.get("global_batch") is not None:
                return int(source["global_batch"])
        return None


def load_run(path: str | Path) -> Run:
    """Parse one metrics file; ReportError names the file and line of anything malformed."""
    path = Path(path)
    run = Run(path=path)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ReportError(f"{path}: cannot read metrics file ({exc.strerror or exc})") from exc
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ReportError(
                f"{path}:{lineno}: not a JSON object ({exc.msg} at column {exc.colno})"
            ) from exc
        if not isinstance(record, dict) or not isinstance(record.get("event"), str):
            raise ReportError(f'{path}:{lineno}: expected a JSON object with an "event" field')
        event = record["event"]
        if event == "step":
            _require(record, STEP_FIELDS, path, lineno)
            run.steps.append(record)
        elif event == "staging":
            _require(record, STAGING_FIELDS, path, lineno)
            run.staging.append(record)
        elif event == "epoch":
            run.epochs.append(record)
        elif event == "start":
            run.start = record
        elif event == "summary":
            run.summary = record
        # other events: written by newer trainers; not part of this report
    if not run.steps:
        raise ReportError(
            f'{path}: no "step" events, so there is nothing to plot; hpcdl.train writes one '
            "every --metrics-every steps (default 10) when run with --metrics PATH: run more "
            "steps than that or pass --metrics-every 1"
        )
    return run


def _require(record: dict[str, Any], names: tuple[str, ...], path: Path, lineno: int) -> None:
    missing = [n for n in names if not isinstance(record.get(n), (int, float))]
    if missing:
        event, fields = record["event"], ", ".join(missing)
        raise ReportError(f'{path}:{lineno}: "{event}" event lacks numeric field(s) {fields}')


# --- numbers ---------------------------------------------------------------------------------


def mean_breakdown(steps: list[dict[str, Any]]) -> dict[str, float]:
    """Mean seconds of each step part (and t_step) over the given step events."""
    names = [name for name, _, _ in BREAKDOWN] + ["t_step"]
    return {n: sum(float(s[n]) for s in steps) / len(steps) for n in names}


def _steps_by_epoch(run: Run) -> dict[int, list[dict[str, Any]]]:
    epochs: dict[int, list[dict[str, Any]]] = {}
    for s in run.steps:
        epochs.setdefault(int(s["epoch"]), []).append(s)
    return dict(sorted(epochs.items()))


def breakdown_by_epoch(run: Run) -> list[tuple[int, dict[str, float]]]:
    return [(e, mean_breakdown(steps)) for e, steps in _steps_by_epoch(run).items()]


def images_per_s(run: Run) -> float | None:
    """Whole-run global images/s: the summary's, else the last epoch's, else the logged steps'."""
    if run.summary and run.summary.get("images_per_s") is not None:
        return float(run.summary["images_per_s"])
    if run.epochs and run.epochs[-1].get("images_per_s") is not None:
        return float(run.epochs[-1]["images_per_s"])
    seconds = sum(float(s["t_step"]) for s in run.steps)
    return sum(_step_images(run, s) for s in run.steps) / seconds if seconds > 0 else None


def val_accuracy(run: Run) -> float | None:
    if run.summary and run.summary.get("val_accuracy") is not None:
        return float(run.summary["val_accuracy"])
    for e in reversed(run.epochs):
        if e.get("val_acc") is not None:
            return float(e["val_acc"])
    return None


def staging_hit_rate(run: Run) -> float | None:
    """Share of training-file reads served from node-local copies, or None without staging."""
    stats = run.summary.get("staging") if run.summary else None
    if not stats:  # no summary: add up the epochs
        per_epoch = [e["staging"] for e in run.epochs if e.get("staging")]
        if not per_epoch:
            return None
        stats = {k: sum(s.get(k, 0) for s in per_epoch) for k in ("hits", "misses")}
    reads = stats.get("hits", 0) + stats.get("misses", 0)
    return stats.get("hits", 0) / reads if reads else None


def summary_lines(run: Run) -> list[str]:
    def fmt(value: float | None, spec: str) -> str:
        return "n/a" if value is None else format(value, spec)

    parts = mean_breakdown(run.steps)
    t_step = parts["t_step"] or float("nan")
    share = ", ".join(
        f"{label} {parts[name] * 1e3:.1f} ms ({100 * parts[name] / t_step:.0f}%)"
        for name, label, _ in BREAKDOWN
    )
    hit = staging_hit_rate(run)
    lines = [
        f"{run.label}:",
        f"  world size {fmt(run.world_size, 'd')}, global batch {fmt(run.global_batch, 'd')}, "
        f"{fmt(images_per_s(run), '.1f')} images/s, val acc {fmt(val_accuracy(run), '.4f')}, "
        f"staging hit rate {'n/a (no staging)' if hit is None else f'{100 * hit:.1f}%'}",
        f"  mean step {t_step * 1e3:.1f} ms over {len(run.steps)} logged steps: {share}",
    ]
    if run.staging:
        lead = [s["files_ready"] - s["consumed_files"] for s in run.staging]
        lines.append(
            f"  staging ahead of the readers by {lead[-1]} files at the last report "
            f"(least {min(lead)}, most {max(lead)})"
        )
    return lines


# --- plots -----------------------------------------------------------------------------------


def render(runs: list[Run], out: Path) -> None:
    """Write the figure: throughput row, breakdown row, staging row (when any run has it)."""
    import matplotlib  # noqa: PLC0415  (plotting stays out of module import)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    with_staging = any(run.staging for run in runs)
    rows, cols = (3 if with_staging else 2), len(runs)
    fig = plt.figure(figsize=(max(7.0, 4.5 * cols), 3.6 * rows), layout="constrained")
    grid = fig.add_gridspec(rows, cols)

    ax = fig.add_subplot(grid[0, :])
    for i, run in enumerate(runs):
        for epoch, steps in _steps_by_epoch(run).items():  # no line across evaluation gaps
            x = [float(s["time"]) - run.t0 for s in steps]
            images = [_step_images(run, s) for s in steps]
            seconds = [float(s["t_step"]) for s in steps]
            rate = [n / max(t, 1e-9) for n, t in zip(images, seconds)]
            ax.plot(x, rate, ".", color=f"C{i}", alpha=0.35, markersize=4)
            label = run.label if epoch == run.steps[0]["epoch"] else None
            ax.plot(x, _windowed_rate(images, seconds, 9), "-", color=f"C{i}", label=label)
    ax.set(title="Throughput", xlabel="seconds since start", ylabel="images/s (global)")
    ax.set_ylim(bottom=0)
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)

    share = None
    top = max(parts["t_step"] for run in runs for _, parts in breakdown_by_epoch(run)) * 1e3
    for i, run in enumerate(runs):
        ax = fig.add_subplot(grid[1, i], sharey=share)
        share = share or ax
        ax.set_ylim(0, 1.35 * top)  # headroom for the legend
        per_epoch = breakdown_by_epoch(run)
        xs = [e + 1 for e, _ in per_epoch]
        bottom = [0.0] * len(xs)
        for name, label, colour in BREAKDOWN:
            heights = [parts[name] * 1e3 for _, parts in per_epoch]
            ax.bar(xs, heights, bottom=bottom, label=label, color=colour, width=0.7)
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        ax.set(title=f"Mean step by epoch: {run.label}", xlabel="epoch", ylabel="ms per step")
        ax.set_xticks(xs)
        ax.grid(axis="y", alpha=0.3)
        if i == 0:
            ax.legend(loc="upper center", ncols=2, fontsize="small")

    if with_staging:
        for i, run in enumerate(runs):
            ax = fig.add_subplot(grid[2, i])
            ax.set(title=f"Staging vs consumption: {run.label}", xlabel="seconds since start")
            if not run.staging:
                ax.text(
                    0.5, 0.5, "no staging events", ha="center", va="center", transform=ax.transAxes
                )
                ax.set_xticks([])
                ax.set_yticks([])
                continue
            x = [float(s["time"]) - run.t0 for s in run.staging]
            ax.plot(x, [s["files_ready"] for s in run.staging], label="files staged (ready)")
            ax.plot(x, [s["consumed_files"] for s in run.staging], label="files consumed")
            ax.set_ylabel("files")
            ax.legend(loc="upper left", fontsize="small")
            ax.grid(alpha=0.3)

    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def _step_images(run: Run, step: dict[str, Any]) -> float:
    """Images in this step over all ranks."""
    if run.global_batch:
        return float(run.global_batch)
    return float(step.get("samples_per_s", 0.0)) * float(step["t_step"])


def _windowed_rate(images: list[float], seconds: list[float], window: int) -> list[float]:
    """Images / seconds over a centred window of steps: a time-weighted throughput."""
    out, half = [], window // 2
    for i in range(len(images)):
        lo, hi = max(0, i - half), i + half + 1
        out.append(sum(images[lo:hi]) / max(sum(seconds[lo:hi]), 1e-9))
    return out


# --- command line ----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hpcdl.report", description=__doc__.split("\n")[0])
    ap.add_argument("metrics", nargs="+", help="metrics JSONL file(s) written by hpcdl.train")
    ap.add_argument("--out", default="report.png", help="PNG to write (default: report.png)")
    ap.add_argument("--labels", help="comma-separated run names, one per metrics file")
    args = ap.parse_args(argv)
    labels = args.labels.split(",") if args.labels else None
    if labels is not None and len(labels) != len(args.metrics):
        ap.error(f"--labels has {len(labels)} name(s) for {len(args.metrics)} metrics file(s)")
    try:
        runs = [load_run(p) for p in args.metrics]
    except ReportError as exc:
        print(f"hpcdl.report: error: {exc}", file=sys.stderr)
        return 1
    for i, run in enumerate(runs):
        ranks = run.world_size
        default = run.path.stem + (f" ({ranks} rank{'s' if ranks != 1 else ''})" if ranks else "")
        run.label = labels[i] if labels else default
    for run in runs:
        print("\n".join(summary_lines(run)))
    render(runs, Path(args.out))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
