"""`python -m hpcdl.report timeline DIR` and `python -m hpcdl.report last DIR`: what the ranks did.

- timeline DIR: DIR is a `--timeline FILE`'s buffer folder (FILE.ranks, left behind by a run
  that did not end normally) or the folder holding it. Merges the ranks' buffers into a Chrome
  trace (Perfetto, chrome://tracing) and draws a few steps of every rank side by side in a PNG,
  for people who won't open a trace viewer.
- last DIR: the flight records of a run that ended abnormally (DIR: the run's directory or its
  flight/ folder): every rank's last events side by side, newest first, the ranks that differ
  from most marked, the ranks without a record named.
How to read both: docs/diagnose.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from hpcdl.diag import flight, timeline
from hpcdl.diag.events import Kind, label
from hpcdl.helpformat import HelpFormatter

COLOURS = {  # kind -> colour in the PNG
    Kind.DATA_WAIT: "#4c72b0",
    Kind.H2D: "#64b5cd",
    Kind.FORWARD: "#55a868",
    Kind.BACKWARD: "#8c8c3c",
    Kind.ALLREDUCE: "#c44e52",
    Kind.COMM_WAIT: "#dd8452",
    Kind.OPTIMIZER: "#8172b2",
    Kind.SYNC: "#937860",
    Kind.EVAL: "#da8bc3",
    Kind.CHECKPOINT: "#333333",
}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m hpcdl.report", description=__doc__.split("\n")[0],
        formatter_class=HelpFormatter, allow_abbrev=False,
    )  # fmt: skip
    sub = ap.add_subparsers(dest="command", required=True)
    tl = sub.add_parser("timeline", help="merge a --timeline's rank buffers; draw a PNG")
    tl.add_argument("dir", help="FILE.ranks folder of --timeline FILE (or its parent)")
    tl.add_argument("--out", help="trace JSON to write (default: FILE beside FILE.ranks)")
    tl.add_argument("--png", help="PNG to draw (default: the trace's name with .png)")
    tl.add_argument("--steps", type=int, default=3, help="steps to draw (default: 3)")
    tl.add_argument("--first-step", type=int, help="first step drawn (default: the last ones)")
    last = sub.add_parser("last", help="the last events of every rank, side by side")
    last.add_argument("dir", help="the run's directory (--checkpoint-dir) or its flight/")
    last.add_argument("--rows", type=int, default=8, help="events per rank (default: 8)")
    return ap


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "last":
            records = flight.read_records(args.dir)
            print(flight.side_by_side(records, rows=args.rows))
            return 0
        return timeline_command(args)
    except (flight.FlightError, FileNotFoundError) as exc:
        print(f"hpcdl.report: error: {exc}", file=sys.stderr)
        return 1


def find_parts(directory: str) -> Path:
    """The FILE.ranks folder given, or the only one inside the folder given."""
    folder = Path(directory)
    if list(folder.glob("rank-*.json")):
        return folder
    found = sorted(folder.glob("*.ranks"))
    if len(found) != 1:
        raise FileNotFoundError(
            f"{folder} holds {len(found)} timeline buffer folders (FILE.ranks); name one"
        )
    return found[0]


def timeline_command(args: argparse.Namespace) -> int:
    parts_dir = find_parts(args.dir)
    out = Path(args.out) if args.out else parts_dir.with_name(parts_dir.name[: -len(".ranks")])
    ranks = timeline.merge(parts_dir, out)
    print(f"wrote {out} ({ranks} ranks): open it in ui.perfetto.dev or chrome://tracing")
    png = Path(args.png) if args.png else out.with_suffix(".png")
    drawn = draw(timeline.read_parts(parts_dir), png, args.steps, args.first_step)
    print(f"wrote {png} (steps {drawn[0]}-{drawn[-1]})" if drawn else f"wrote {png} (no steps)")
    return 0


def draw(parts: list, png: Path, steps: int, first: int | None) -> list[int]:
    """Every rank's events of `steps` steps as bars, one row per rank (allreduces beneath the
    training thread's row); returns the steps drawn."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    all_steps = sorted({int(s) for _, r in parts for s in r["step"]})
    if first is None:
        first = all_steps[max(0, len(all_steps) - steps - 1)] if all_steps else 0
    chosen = [s for s in all_steps if first <= s < first + steps]
    fig, ax = plt.subplots(figsize=(12, 1 + 0.6 * len(parts)))
    seen: set[int] = set()
    for row, (_, records) in enumerate(parts):
        mine = records[np.isin(records["step"], chosen) & (records["kind"] > 0)]
        for kind, t0, t1 in zip(mine["kind"], mine["t0"], mine["t1"]):
            lane = row + (0.3 if kind == Kind.ALLREDUCE else 0.0)
            height = 0.25 if kind == Kind.ALLREDUCE else 0.55
            name = label(kind) if kind not in seen else None
            seen.add(int(kind))
            ax.barh(lane, (t1 - t0) * 1e3, left=t0 * 1e3, height=height,
                    color=COLOURS.get(int(kind), "#999999"), label=name)  # fmt: skip
    ax.set_yticks(range(len(parts)), [f"rank {w['rank']} ({w['host']})" for w, _ in parts])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the clock alignment at start-up")
    ax.set_title(f"steps {chosen[0]}-{chosen[-1]}" if chosen else "no steps recorded")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return chosen
