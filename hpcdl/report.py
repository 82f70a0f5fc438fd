"""`python -m hpcdl.report METRICS.jsonl [MORE.jsonl ...] --out report.png`: where time goes.

Reads the metrics JSON lines of `hpcdl.train --metrics` (format: docs/internals.md) and draws,
for one run or several side by side: throughput over time, the mean step broken into data
wait / compute / exposed communication / update per epoch (stacked bars), the learning curve
(loss and accuracy per epoch), and staging progress against consumption when the run has
`staging` events. A short text summary goes to stdout. How to read it: docs/report.md.

hpcdl.train appends to an existing metrics file, and every run begins with a `start` event: a
file is split into runs there (hpcdl.metrics_file, the one reader), and only its last run is
reported unless --all-runs is given.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hpcdl.clustermodel import comparison
from hpcdl.figure_file import FigureFileError, checked_or_exit, save_figure
from hpcdl.helpformat import HelpFormatter
from hpcdl.metrics_file import (
    BREAKDOWN,
    ReportError,
    Run,
    breakdown_by_epoch,
    check_steps,
    load_runs,
    step_images,
    steps_by_epoch,
    summary_lines,
)

LEARNING_CURVES = (  # (epoch event field, legend label, axis, line style)
    ("loss", "train loss", "loss", "o-"),
    ("val_loss", "val loss", "loss", "o--"),
    ("acc", "train acc", "accuracy", "s-"),
    ("val_acc", "val acc", "accuracy", "s--"),
)


# --- plots -----------------------------------------------------------------------------------


def render(runs: list[Run], out: Path) -> None:
    """Write the figure of build_figure(runs) to out (its extension gives the format)."""
    save_figure(build_figure(runs), out, dpi=100)


def build_figure(runs: list[Run]):  # -> matplotlib.figure.Figure
    """Throughput row; one column per run below it: step breakdown, learning curve, staging."""
    import matplotlib  # noqa: PLC0415  (plotting stays out of module import)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    with_staging = any(run.staging for run in runs)
    rows, cols = (4 if with_staging else 3), len(runs)
    fig = plt.figure(figsize=(max(7.0, 4.5 * cols), 3.6 * rows), layout="constrained")
    grid = fig.add_gridspec(rows, cols)
    _throughput_panel(fig.add_subplot(grid[0, :]), runs)
    share = None
    top = max(parts["t_step"] for run in runs for _, parts in breakdown_by_epoch(run)) * 1e3
    for i, run in enumerate(runs):
        ax = fig.add_subplot(grid[1, i], sharey=share)
        share = share or ax
        _breakdown_panel(ax, run, top, legend=i == 0)
        _learning_panel(fig.add_subplot(grid[2, i]), run)
        if with_staging:
            _staging_panel(fig.add_subplot(grid[3, i]), run)
    return fig


def _throughput_panel(ax, runs: list[Run]) -> None:
    for i, run in enumerate(runs):
        for epoch, steps in steps_by_epoch(run).items():  # no line across evaluation gaps
            x = [float(s["time"]) - run.t0 for s in steps]
            images = [step_images(run, s) for s in steps]
            seconds = [float(s["t_step"]) for s in steps]
            rate = [n / max(t, 1e-9) for n, t in zip(images, seconds)]
            ax.plot(x, rate, ".", color=f"C{i}", alpha=0.35, markersize=4)
            label = run.label if epoch == run.steps[0]["epoch"] else None
            ax.plot(x, _windowed_rate(images, seconds, 9), "-", color=f"C{i}", label=label)
    ax.set(title="Throughput", xlabel="seconds since start", ylabel="images/s (global)")
    ax.set_ylim(bottom=0)
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)


def _breakdown_panel(ax, run: Run, top_ms: float, legend: bool) -> None:
    ax.set_ylim(0, 1.35 * top_ms)  # headroom for the legend
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
    if legend:
        ax.legend(loc="upper center", ncols=2, fontsize="small")


def _learning_panel(ax, run: Run) -> None:
    """Loss (left axis) and accuracy (right axis) per epoch; solid: training, dashed: validation."""
    ax.set(title=f"Learning curve: {run.label}", xlabel="epoch", ylabel="loss")
    if not run.epochs:
        _no_data(ax, "no epoch events")
        return
    acc_ax = ax.twinx()  # drawn over ax: the legend goes on it, in headroom above the curves
    acc_ax.set(ylabel="accuracy", ylim=(0, 1.35), yticks=[0, 0.2, 0.4, 0.6, 0.8, 1.0])
    losses = [0.0]
    for key, label, axis, style in LEARNING_CURVES:
        points = [
            (int(e["epoch"]) + 1, float(e[key]))
            for e in run.epochs
            if isinstance(e.get(key), (int, float))
        ]
        if points:
            xs, ys = zip(*points)
            target = ax if axis == "loss" else acc_ax
            target.plot(xs, ys, style, color="C0" if axis == "loss" else "C1", label=label)
            if axis == "loss":
                losses += ys
    ax.set_ylim(0, 1.35 * (max(losses) or 1.0))
    ax.set_xticks(sorted({int(e["epoch"]) + 1 for e in run.epochs}))
    handles = ax.get_legend_handles_labels()[0] + acc_ax.get_legend_handles_labels()[0]
    acc_ax.legend(handles=handles, loc="upper center", ncols=2, fontsize="small")
    ax.grid(alpha=0.3)


def _staging_panel(ax, run: Run) -> None:
    ax.set(title=f"Staging vs consumption: {run.label}", xlabel="seconds since start")
    if not run.staging:
        _no_data(ax, "no staging events")
        return
    x = [float(s["time"]) - run.t0 for s in run.staging]
    ax.plot(x, [s["files_ready"] for s in run.staging], label="files staged (ready)")
    ax.plot(x, [s["consumed_files"] for s in run.staging], label="files consumed")
    ax.set_ylabel("files")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", fontsize="small")
    ax.grid(alpha=0.3)


def _no_data(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def _windowed_rate(images: list[float], seconds: list[float], window: int) -> list[float]:
    """Images / seconds over a centred window of steps: a time-weighted throughput."""
    out, half = [], window // 2
    for i in range(len(images)):
        lo, hi = max(0, i - half), i + half + 1
        out.append(sum(images[lo:hi]) / max(sum(seconds[lo:hi]), 1e-9))
    return out


# --- command line ----------------------------------------------------------------------------


def select_runs(paths: list[str], all_runs: bool) -> tuple[list[Run], list[str]]:
    """Each file's last run (or, with all_runs, every run with steps), labelled; notes to print."""
    runs, notes = [], []
    for path in paths:
        in_file = load_runs(path)
        count = len(in_file)
        if in_file[-1].cut_line:
            notes.append(f"{path}:{in_file[-1].cut_line}: skipped its last line, which was cut "
                         "short (no newline: the run was killed, or the disk full, as it wrote "
                         "it)")  # fmt: skip
        chosen = [r for r in in_file if r.steps] if all_runs else []
        if not chosen:
            chosen = [check_steps(in_file[-1], count)]
            if count > 1:
                notes.append(
                    f"{path} holds {count} runs (hpcdl.train appends to its --metrics file); "
                    f"reporting the last one, from line {chosen[0].first_line} "
                    "(--all-runs: all of them)"
                )
        elif len(chosen) < count:
            notes.append(f'{path}: left out {count - len(chosen)} run(s) without "step" events')
        for run in chosen:
            number = f" run {in_file.index(run) + 1}/{count}" if len(chosen) > 1 else ""
            ranks = run.world_size
            plural = "s" if ranks != 1 else ""
            run.label = run.path.stem + number + (f" ({ranks} rank{plural})" if ranks else "")
        runs += chosen
    return runs, notes


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m hpcdl.report",
        description=__doc__.split("\n")[0],
        allow_abbrev=False,
        formatter_class=HelpFormatter,
    )
    ap.add_argument("metrics", nargs="+", help="metrics JSONL file(s) written by hpcdl.train")
    ap.add_argument(
        "--out",
        default="report.png",
        help="figure to write; its extension gives the format: png, pdf, svg, ... "
        "(default: report.png)",
    )
    ap.add_argument(
        "--labels", help="comma-separated run names, one per run drawn (default: file names)"
    )
    ap.add_argument(
        "--predicted",
        help="the JSON of hpcdl.stage --dry-run --calibration --json: also draw predicted vs "
        "measured epoch times into OUT-model.png (docs/cluster-model.md)",
    )
    ap.add_argument(
        "--all-runs",
        action="store_true",
        help="draw every run of a file that several runs appended to (default: the last one)",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("timeline", "last"):  # what the ranks did (hpcdl.report_diag)
        from hpcdl import report_diag  # noqa: PLC0415

        return report_diag.main(argv)
    ap = build_parser()
    args = ap.parse_args(argv)
    out = checked_or_exit(ap, args.out, "--out")
    try:  # every input is read before anything is drawn
        predictions = comparison.load_predictions(args.predicted) if args.predicted else None
    except ReportError as exc:
        print(f"hpcdl.report: error: {exc}", file=sys.stderr)
        return 2
    try:
        runs, notes = select_runs(args.metrics, args.all_runs)
    except ReportError as exc:
        print(f"hpcdl.report: error: {exc}", file=sys.stderr)
        return 1
    if args.labels:
        labels = args.labels.split(",")
        if len(labels) != len(runs):
            ap.error(f"--labels has {len(labels)} name(s) for {len(runs)} run(s) to draw")
        for run, label in zip(runs, labels):
            run.label = label
    if predictions is not None and not any(comparison.match(r, predictions) for r in runs):
        print(f"hpcdl.report: error: --predicted {args.predicted} holds no prediction for the "
              "world size of these runs; run the dry run with their --nodes and "
              "--ranks-per-node", file=sys.stderr)  # fmt: skip
        return 1
    for note in notes:
        print(note)
    for run in runs:
        print("\n".join(summary_lines(run)))
    try:
        render(runs, out)
        print(f"wrote {out}")
        if predictions is not None:
            comparison.render_comparison(runs, predictions, out.with_name(f"{out.stem}-model.png"))
    except FigureFileError as exc:
        print(f"hpcdl.report: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from hpcdl import cli

    sys.exit(cli.run(main))
