"""A metrics JSON-lines file read back: its runs, their steps and the figures a summary shows.

`hpcdl.train --metrics` writes the file (hpcdl.metrics; format in docs/internals.md). Every run
begins with a `start` event and hpcdl.train appends, so a file is split into runs there. This is
the one reader: `python -m hpcdl.report` draws from it, hpcdl.clustermodel.comparison compares
it with the cluster model's prediction, and the benchmarks that train (`bench train`,
vs_torch) take their figures from it.
"""

from __future__ import annotations

import json
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
    """The events of one run (one `start` event and what follows it), grouped by kind."""

    path: Path
    label: str = ""
    first_line: int = 1  # line of the file where this run's events begin
    start: dict[str, Any] | None = None
    steps: list[dict[str, Any]] = field(default_factory=list)
    epochs: list[dict[str, Any]] = field(default_factory=list)
    staging: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] | None = None
    cut_line: int | None = None  # a last line cut short (the file's last run): skipped, here

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


def load_runs(path: str | Path) -> list[Run]:
    """Every run in one metrics file, oldest first: each `start` event begins a new run.

    ReportError names the file and line of anything malformed, except a last line without its
    newline: hpcdl.train was killed, or the disk filled, while writing it, so it is skipped and
    its number kept in the last run's `cut_line`. Runs are not checked for `step` events here;
    load_run and main do that for the runs they report.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ReportError(f"{path}: cannot read metrics file ({exc.strerror or exc})") from exc
    except UnicodeDecodeError as exc:  # a checkpoint, an events file: any binary file
        raise ReportError(
            f"{path}: not a metrics JSON-lines file (byte {exc.start} is not UTF-8 text); "
            "pass the file hpcdl.train --metrics wrote"
        ) from None
    lines = text.splitlines()
    cut = len(lines) if lines and not text.endswith("\n") else None  # a write stopped midway
    runs = [Run(path=path)]
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = _parse_line(line, path, lineno)
        except ReportError:
            if lineno != cut:
                raise
            runs[-1].cut_line = lineno
            break
        run = runs[-1]
        if record["event"] == "start" and _has_events(run):
            run = Run(path=path, first_line=lineno)
            runs.append(run)
        _add_event(run, record, path, lineno)
    return runs


def load_run(path: str | Path) -> Run:
    """The last run in one metrics file; ReportError if it has no `step` events to plot."""
    runs = load_runs(path)
    return check_steps(runs[-1], len(runs))


def check_steps(run: Run, runs_in_file: int = 1) -> Run:
    """`run`, or ReportError saying what to do when it has no `step` events."""
    if run.steps:
        return run
    which = (
        f"the last of its {runs_in_file} runs (from line {run.first_line}) has no"
        if runs_in_file > 1
        else "no"
    )
    raise ReportError(
        f'{run.path}: {which} "step" events, so there is nothing to plot; hpcdl.train writes '
        "one every --metrics-every steps (default 10) when run with --metrics PATH: run more "
        "steps than that or pass --metrics-every 1"
        + ("; --all-runs reports the earlier runs" if runs_in_file > 1 else "")
    )


def _parse_line(line: str, path: Path, lineno: int) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ReportError(
            f"{path}:{lineno}: not a JSON object ({exc.msg} at column {exc.colno})"
        ) from exc
    if not isinstance(record, dict) or not isinstance(record.get("event"), str):
        raise ReportError(f'{path}:{lineno}: expected a JSON object with an "event" field')
    return record


def _has_events(run: Run) -> bool:
    return bool(run.start or run.steps or run.epochs or run.staging or run.summary)


def _add_event(run: Run, record: dict[str, Any], path: Path, lineno: int) -> None:
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


def step_images(run: Run, step: dict[str, Any]) -> float:
    """Images in this step over all ranks."""
    if run.global_batch:
        return float(run.global_batch)
    return float(step.get("samples_per_s", 0.0)) * float(step["t_step"])


def steps_by_epoch(run: Run) -> dict[int, list[dict[str, Any]]]:
    epochs: dict[int, list[dict[str, Any]]] = {}
    for s in run.steps:
        epochs.setdefault(int(s["epoch"]), []).append(s)
    return dict(sorted(epochs.items()))


def breakdown_by_epoch(run: Run) -> list[tuple[int, dict[str, float]]]:
    return [(e, mean_breakdown(steps)) for e, steps in steps_by_epoch(run).items()]


def unfinished_line(run: Run) -> str | None:
    """For a run without its `summary` event, the line that says so and where its figures come
    from instead; None for a finished run."""
    if run.summary is not None:
        return None
    last = run.epochs[-1] if run.epochs else None
    source = (
        f"images/s is its last epoch's (epoch {int(last['epoch']) + 1}), not the whole run's"
        if last and last.get("images_per_s") is not None
        else f"images/s is the mean of its {len(run.steps)} logged steps"
    )
    return (
        '  no "summary" event, so the run did not finish (it failed, was killed or is still '
        f"running): {source}"
    )


def images_per_s(run: Run) -> float | None:
    """Whole-run global images/s: the summary's, else the last epoch's, else the logged steps'."""
    if run.summary and run.summary.get("images_per_s") is not None:
        return float(run.summary["images_per_s"])
    if run.epochs and run.epochs[-1].get("images_per_s") is not None:
        return float(run.epochs[-1]["images_per_s"])
    seconds = sum(float(s["t_step"]) for s in run.steps)
    return sum(step_images(run, s) for s in run.steps) / seconds if seconds > 0 else None


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
        *filter(None, [unfinished_line(run)]),
        f"  mean step {t_step * 1e3:.1f} ms over {len(run.steps)} logged steps: {share}",
    ]
    if run.staging:
        lead = [s["files_ready"] - s["consumed_files"] for s in run.staging]
        lines.append(
            f"  staging ahead of the readers by {lead[-1]} files at the last report "
            f"(least {min(lead)}, most {max(lead)})"
        )
    return lines
