"""A stage-only run's view of its stager (`python -m hpcdl.stage`, hpcdl-stage --once): the
progress lines while it copies, and the node's summary from its status header once it exits."""

from __future__ import annotations

import sys
import time
from typing import Any

from hpcdl.staging.plan import NodePlan
from hpcdl.staging.status import StatusView


def show_progress(proc: Any, status: StatusView, node: int, quiet: bool) -> None:
    """Show staging progress until the stager exits: a live line on a terminal, else a line
    per 10 % (job logs)."""
    tty = sys.stderr.isatty() and not quiet
    last_decile = -1
    while proc.poll() is None:
        time.sleep(0.1)
        if quiet or not status.open() or status.field("pid") != proc.pid:
            status.close()
            continue
        ready, total = status.field("plan_ready"), max(status.field("plan_entries"), 1)
        if tty:
            print(f"\rnode {node}: {ready}/{total} files staged", end="", file=sys.stderr)
        elif ready * 10 // total > last_decile:
            last_decile = ready * 10 // total
            print(f"node {node}: {last_decile * 10}% ({ready}/{total} files)", file=sys.stderr)
    if tty:
        print(file=sys.stderr)


def print_summary(status: StatusView, plan: NodePlan, node: int, seconds: float) -> dict[str, Any]:
    """Print the node's one-line summary from the stager's status header; return it."""
    h = status.header()
    files = h["files_staged"] + h["files_reused"]
    nbytes = h["bytes_staged"] + h["bytes_reused"]
    summary = dict(
        node=node,
        files=files,
        bytes=nbytes,
        copied=h["files_staged"],
        reused=h["files_reused"],
        planned=plan.files,
        planned_bytes=plan.bytes,
        seconds=round(seconds, 3),
        mb_per_s=round(h["bytes_staged"] / 1e6 / seconds, 1),
        files_per_s=round(h["files_staged"] / seconds, 1),
        failures=h["failures"],
        no_space=status.has_flag("NOSPACE"),
        capacity_full=status.has_flag("CAPACITY_FULL"),
    )
    note = ""
    if files < plan.files:
        note = (
            f"; {plan.files - files - h['failures']} files left on the PFS "
            f"({'no space left' if summary['no_space'] else 'capacity reached'})"
        )
    print(
        f"node {node}: staged {files} files ({nbytes / 1e6:.1f} MB; {h['files_staged']} copied, "
        f"{h['files_reused']} reused) in {seconds:.2f} s: {summary['mb_per_s']} MB/s, "
        f"{summary['files_per_s']} files/s, {h['failures']} failures{note}"
    )
    return summary
