"""`python -m hpcdl.report timeline DIR` and `python -m hpcdl.report last DIR`: what the ranks did.

- timeline DIR: DIR is a `--timeline FILE`'s buffer folder (FILE.ranks, left behind by a run
  that did not end normally) or the folder holding it: merges the ranks' buffers into a Chrome
  trace (Perfetto, chrome://tracing). Then (or given FILE itself) draws a few steps of every
  rank side by side in a PNG, for people who won't open a trace viewer.
- last DIR: the flight records of a run that ended abnormally (DIR: the run's directory or its
  flight/ folder): every rank's last events side by side, newest first, the ranks that differ
  from most marked, the ranks without a record named.
How to read both: docs/diagnose.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hpcdl.diag import flight, timeline
from hpcdl.diag.events import Kind, label
from hpcdl.figure_file import FigureFileError, checked_or_exit, save_figure
from hpcdl.helpformat import HelpFormatter

COLOURS = {  # event name -> colour in the PNG
    label(Kind.DATA_WAIT): "#4c72b0",
    label(Kind.H2D): "#64b5cd",
    label(Kind.FORWARD): "#55a868",
    label(Kind.BACKWARD): "#8c8c3c",
    label(Kind.ALLREDUCE): "#c44e52",
    label(Kind.COMM_WAIT): "#dd8452",
    label(Kind.OPTIMIZER): "#8172b2",
    label(Kind.SYNC): "#937860",
    label(Kind.EVAL): "#da8bc3",
    label(Kind.CHECKPOINT): "#333333",
}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m hpcdl.report", description=__doc__.split("\n")[0],
        formatter_class=HelpFormatter, allow_abbrev=False,
    )  # fmt: skip
    sub = ap.add_subparsers(dest="command", required=True)
    tl = sub.add_parser("timeline", help="merge a --timeline's rank buffers; draw a PNG")
    tl.add_argument(
        "dir", help="--timeline FILE's trace, or its FILE.ranks buffers (or their folder)"
    )
    tl.add_argument("--out", help="trace JSON to write (default: FILE beside FILE.ranks)")
    tl.add_argument(
        "--png", help="figure to draw: png, pdf, svg, ... (default: the trace's name with .png)"
    )
    tl.add_argument("--steps", type=int, default=3, help="steps to draw (default: 3)")
    tl.add_argument("--first-step", type=int, help="first step drawn (default: the last ones)")
    last = sub.add_parser("last", help="the last events of every rank, side by side")
    last.add_argument("dir", help="the run's directory (--checkpoint-dir) or its flight/")
    last.add_argument("--rows", type=int, default=8, help="events per rank (default: 8)")
    return ap


def main(argv: list[str]) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.command == "timeline":
        checked_or_exit(ap, args.png, "--png")
        if not Path(args.dir).exists():
            print(f"hpcdl.report: error: {args.dir} does not exist; name a --timeline trace, its "
                  "FILE.ranks folder or the folder holding that", file=sys.stderr)  # fmt: skip
            return 2
    try:
        if args.command == "last":
            records = flight.read_records(args.dir)
            print(flight.side_by_side(records, rows=args.rows))
            return 0
        return timeline_command(args)
    except (flight.FlightError, FileNotFoundError, FigureFileError) as exc:
        print(f"hpcdl.report: error: {exc}", file=sys.stderr)
        return 1


def find_parts(directory: Path) -> Path:
    """The FILE.ranks folder given, or the only one inside the folder given."""
    if list(directory.glob("rank-*.json")):
        return directory
    found = sorted(directory.glob("*.ranks"))
    if len(found) != 1:
        raise FileNotFoundError(
            f"{directory} holds {len(found)} timeline buffer folders (FILE.ranks); name one"
        )
    return found[0]


def timeline_command(args: argparse.Namespace) -> int:
    given = Path(args.dir)
    if given.is_file():  # a trace written at the end of a run: draw it
        out = given
    else:
        parts_dir = find_parts(given)
        out = Path(args.out) if args.out else parts_dir.with_name(parts_dir.name[: -len(".ranks")])
        ranks = timeline.merge(parts_dir, out)
        print(f"wrote {out} ({ranks} ranks): open it in ui.perfetto.dev or chrome://tracing")
    try:
        events = json.loads(out.read_text())["traceEvents"]
    except (OSError, ValueError, KeyError) as exc:
        raise FileNotFoundError(f"{out} is not a Chrome trace of --timeline ({exc})") from None
    png = Path(args.png) if args.png else out.with_suffix(".png")
    drawn = draw(events, png, args.steps, args.first_step)
    print(f"wrote {png} (steps {drawn[0]}-{drawn[-1]})" if drawn else f"wrote {png} (no steps)")
    return 0


def draw(events: list[dict], png: Path, steps: int, first: int | None) -> list[int]:
    """Every rank's events of `steps` steps as bars, one row per rank (allreduces beneath the
    training thread's row); returns the steps drawn."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    tracks = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    spans = [e for e in events if e["ph"] == "X"]
    all_steps = sorted({e["args"]["step"] for e in spans})
    if first is None:  # the last complete steps
        first = all_steps[max(0, len(all_steps) - steps - 1)] if all_steps else 0
    chosen = [s for s in all_steps if first <= s < first + steps]
    ranks = sorted(tracks)
    fig, ax = plt.subplots(figsize=(12, 1 + 0.6 * len(ranks)))
    seen: set[str] = set()
    for e in spans:
        if e["args"]["step"] not in chosen:
            continue
        lane = ranks.index(e["pid"]) + (0.3 if e["tid"] == 1 else 0.0)
        ax.barh(lane, e["dur"] / 1e3, left=e["ts"] / 1e3, height=0.25 if e["tid"] else 0.55,
                color=COLOURS.get(e["name"], "#999999"),
                label=None if e["name"] in seen else e["name"])  # fmt: skip
        seen.add(e["name"])
    ax.set_yticks(range(len(ranks)), [tracks[r] for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the clock alignment at start-up (allreduces: the thin bars)")
    ax.set_title(f"steps {chosen[0]}-{chosen[-1]}" if chosen else "no steps recorded")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    fig.tight_layout()
    save_figure(fig, png, dpi=110)
    return chosen
