"""The flight recorder: on an abnormal end, each rank writes its last events to the run's directory.

A record is `<dir>/flight/rank-R.json`: who (rank, host, pid), why (the reason given by the code
that saw the end: a signal, the loader's watchdog, a stall shutdown, a lost node, an exception),
the run it belongs to (a start time shared by every rank, so files of an earlier run in the
same directory are told apart), what the rank was doing right then (its heartbeat slot: the
wait it was in and since when) and its last FLIGHT_EVENTS events, with times in seconds
before the dump. A dump never raises and never waits for another rank: it runs where things
are already going wrong (an excepthook, a failure-notice thread, a signal).

`python -m hpcdl.report last DIR` reads them back (read_records, side_by_side).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from hpcdl.diag.events import (
    FLIGHT_EVENTS,
    RECORDER,
    SINCE,
    STATE,
    STEP,
    Recorder,
    label,
)


@dataclass
class FlightPlan:
    """Where and as whom this process dumps; set by the diagnostics session."""

    directory: Path | None = None  # the run's directory; None: no dump
    rank: int = 0
    world_size: int = 1
    run_id: float = 0.0  # rank 0's start time: every rank's records of one run share it
    dumped: bool = False  # one record per process: the first reason is the real one


PLAN = FlightPlan()


def dump(reason: str, recorder: Recorder = RECORDER) -> Path | None:
    """Write this rank's flight record (once per process); its path, or None. Never raises."""
    if PLAN.directory is None or PLAN.dumped:
        return None
    PLAN.dumped = True
    now = time.perf_counter()
    slot = recorder.slot.copy()
    record = {
        "rank": PLAN.rank,
        "world_size": PLAN.world_size,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "run": PLAN.run_id,
        "reason": reason,
        "wall_time": time.time(),
        "step": int(slot[STEP]),
        "waiting": label(slot[STATE]) if slot[STATE] else None,
        "waiting_s": round(now - slot[SINCE], 6) if slot[STATE] else None,
        "recorded": recorder.recorded,
        # [kind, step, seconds before the dump at its start, duration, arg], oldest first
        "events": [
            [label(k), s, round(now - t0, 6), round(t1 - t0, 6), a]
            for k, t0, t1, s, a in recorder.last(FLIGHT_EVENTS)
        ],
    }
    path = PLAN.directory / "flight" / f"rank-{PLAN.rank:05d}.json"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)
    except OSError:  # a full disk, say: no record, and no partial file
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        return None
    return path


class FlightError(Exception):
    """No flight record to read; the message names the directory and what to do."""


def read_records(directory: str | Path) -> list[dict]:
    """The newest run's flight records in DIR (the run's directory or its flight/), by rank."""
    root = Path(directory)
    folder = root / "flight" if (root / "flight").is_dir() else root
    records = []
    for path in sorted(folder.glob("rank-*.json")):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError) as exc:
            raise FlightError(f"{path} is not a flight record ({exc}); remove it") from None
    if not records:
        raise FlightError(
            f"{folder} holds no flight record (rank-R.json): a run that ends abnormally writes "
            "them into flight/ in its --checkpoint-dir (else beside --metrics or --timeline)"
        )
    newest = max(r["run"] for r in records)
    return sorted((r for r in records if r["run"] == newest), key=lambda r: r["rank"])


SHORT = {"gradient allreduce wait": "comm wait", "host-to-device copy": "h2d",
         "process did not run": "frozen"}  # fmt: skip


def _cell(event: list) -> str:
    kind, step, ago, duration, _ = event
    return f"{SHORT.get(kind, kind)} s{step} -{ago:.2f}s ({duration * 1e3:.1f} ms)"


def _ranks(numbers: list[int]) -> str:
    """1, 2, 3, 5 -> "1-3, 5"."""
    spans: list[list[int]] = []
    for n in numbers:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


def _state(r: dict) -> str:
    last = r["events"][-1] if r["events"] else None
    doing = f"in {SHORT.get(r['waiting'], r['waiting'])} {r['waiting_s']:.1f} s" if (
        r["waiting"]) else "running"  # fmt: skip
    return f"step {r['step']}, {doing}, last {SHORT.get(last[0], last[0]) if last else 'none'}"


def side_by_side(records: list[dict], world_size: int | None = None, rows: int = 8) -> str:
    """The last events side by side, newest first: one column per group of ranks in the same
    state (step, the wait they are in, their last event), shown by its lowest rank, so that a
    thousand ranks that all wait read as one column; `*` marks the groups other than the
    largest, and ranks without a record are listed."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        last = r["events"][-1][:2] if r["events"] else None
        groups.setdefault((r["step"], r["waiting"], str(last)), []).append(r)
    columns = list(groups.values())
    largest = max(range(len(columns)), key=lambda k: len(columns[k]))
    width = min(70, max(34, 118 // len(columns) - 2))  # a few columns: room to read
    head = []
    for k, column in enumerate(columns):
        mark = "*" if k != largest else " "
        hosts = sorted({r["host"] for r in column})
        where = hosts[0] if len(hosts) == 1 else f"{len(hosts)} hosts"
        word = "rank" if len(column) == 1 else "ranks"
        head.append(f"{mark}{word} {_ranks([r['rank'] for r in column])} ({where})")
    lines = ["  ".join(h[:width].ljust(width) for h in head)]
    lines.append("  ".join(c[0]["reason"][:width].ljust(width) for c in columns))
    lines.append("  ".join(_state(c[0])[:width].ljust(width) for c in columns))
    for i in range(rows):
        events = [c[0]["events"] for c in columns]
        cells = [_cell(e[-1 - i]) if i < len(e) else "" for e in events]
        lines.append("  ".join(c[:width].ljust(width) for c in cells).rstrip())
    if world_size is None:
        world_size = max(r.get("world_size", r["rank"] + 1) for r in records)
    missing = sorted(set(range(world_size)) - {r["rank"] for r in records})
    if missing:
        lines.append(
            f"no record from rank(s) {_ranks(missing)}: killed before they could write "
            "(stopped, or lost with their node?)"
        )
    if len(columns) > 1:
        lines.append("* : in another state than the largest group of ranks")
    return "\n".join(line.rstrip() for line in lines)
