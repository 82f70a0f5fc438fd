"""Predicted against measured: `python -m hpcdl.report METRICS.jsonl --predicted PRED.json`.

PRED.json is the last line of `python -m hpcdl.stage --dry-run --calibration FILE --json`
(docs/cluster-model.md). Each run is matched with the prediction for its world size (nodes x
ranks per node); the figure has one panel per run, with the seconds of every epoch as measured
and as predicted, and the images/s of both in the title.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hpcdl.figure_file import save_figure
from hpcdl.metrics_file import ReportError, Run


def load_predictions(path: str | Path) -> list[dict[str, Any]]:
    """The `predictions` list of a dry run's JSON (the file, or its last line)."""
    try:
        lines = Path(path).read_text().strip().splitlines()
        predictions = list(json.loads(lines[-1])["predictions"])
        if not all(_has_shape(p) for p in predictions):
            raise ValueError('a prediction without integer "nodes" and "ranks_per_node"')
        return predictions
    except FileNotFoundError:
        raise ReportError(
            f"--predicted {path} does not exist; write it with python -m hpcdl.stage --dry-run "
            f"--calibration FILE --json > {path}"
        ) from None
    except (OSError, IndexError, KeyError, TypeError, ValueError) as exc:
        raise ReportError(
            f"--predicted {path}: not the JSON of hpcdl.stage --dry-run --calibration --json "
            f"({exc})"
        ) from None


def _has_shape(prediction: Any) -> bool:
    """Whether a prediction holds what match() reads."""
    return isinstance(prediction, dict) and all(
        isinstance(prediction.get(key), int) for key in ("nodes", "ranks_per_node")
    )


def match(run: Run, predictions: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The prediction for the run's world size, if the dry run made one."""
    for p in predictions:
        if p["nodes"] * p["ranks_per_node"] == run.world_size:
            return p
    return None


def predicted_epochs(p: dict[str, Any], epochs: int) -> list[float]:
    return [p["epoch1_s"]] + [p["later_epoch_s"]] * (epochs - 1)


def comparison_lines(run: Run, p: dict[str, Any]) -> list[str]:
    measured = [float(e["seconds"]) for e in run.epochs]
    lines = [f"{run.label}: predicted ({p['nodes']} nodes x {p['ranks_per_node']}) vs measured"]
    for i, (want, got) in enumerate(zip(predicted_epochs(p, len(measured)), measured), 1):
        lines.append(f"  epoch {i}: {want:.2f} s predicted, {got:.2f} s measured "
                     f"({got / want - 1:+.1%})")  # fmt: skip
    return lines


def render_comparison(runs: list[Run], predictions: list[dict[str, Any]], out: Path) -> int:
    """Write the predicted-vs-measured PNG and print the comparison; returns runs matched."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    pairs = [(run, match(run, predictions)) for run in runs]
    pairs = [(run, p) for run, p in pairs if p is not None]
    if not pairs:
        return 0
    fig, axes = plt.subplots(1, len(pairs), figsize=(4.5 * len(pairs), 3.6), squeeze=False)
    for ax, (run, p) in zip(axes[0], pairs):
        print("\n".join(comparison_lines(run, p)))
        measured = [float(e["seconds"]) for e in run.epochs]
        xs = range(1, len(measured) + 1)
        ax.bar([x - 0.2 for x in xs], predicted_epochs(p, len(measured)), 0.4, label="predicted")
        ax.bar([x + 0.2 for x in xs], measured, 0.4, label="measured")
        rate = run.summary.get("images_per_s") if run.summary else None
        shown = f", measured {rate:.0f}" if rate else ""
        ax.set(title=f"{run.label}\n{p['images_per_s']:.0f} images/s predicted{shown}",
               xlabel="epoch", ylabel="seconds")  # fmt: skip
        ax.legend()
    fig.tight_layout()
    save_figure(fig, out, dpi=100)
    print(f"wrote {out}")
    return len(pairs)
