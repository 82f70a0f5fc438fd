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


def _cell(event: list) -> str:
    kind, step, ago, duration, _ = event
    return f"{kind} s{step} -{ago:.2f}s ({duration * 1e3:.1f} ms)"


def side_by_side(records: list[dict], world_size: int | None = None, rows: int = 8) -> str:
    """Every rank's last events in columns, newest first; `*` marks ranks whose state or last
    event differs from most ranks', and ranks without a record are listed."""

    def state(r: dict) -> str:
        last = r["events"][-1] if r["events"] else None
        doing = f"in {r['waiting']} for {r['waiting_s']:.1f} s" if r["waiting"] else "running"
        return f"step {r['step']}, {doing}, last {last[0] if last else 'none'}"

    states = [state(r) for r in records]
    common = max(set(states), key=states.count)
    mark = {r["rank"]: ("*" if s != common and len(set(states)) > 1 else " ")
            for r, s in zip(records, states)}  # fmt: skip
    width = 34
    head = [f"{mark[r['rank']]}rank {r['rank']} ({r['host']})"[:width] for r in records]
    lines = ["  ".join(h.ljust(width) for h in head)]
    lines.append("  ".join(r["reason"][:width].ljust(width) for r in records))
    lines.append("  ".join(s[:width].ljust(width) for s in states))
    for i in range(rows):
        cells = [_cell(r["events"][-1 - i]) if i < len(r["events"]) else "" for r in records]
        lines.append("  ".join(c[:width].ljust(width) for c in cells))
    if world_size is None:
        world_size = max(r.get("world_size", r["rank"] + 1) for r in records)
    missing = sorted(set(range(world_size)) - {r["rank"] for r in records})
    if missing:
        lines.append(
            f"no record from rank(s) {', '.join(map(str, missing))}: killed before they could "
            "write (stopped, or lost with their node?)"
        )
    if any(m == "*" for m in mark.values()):
        lines.append("* : state or last event differs from most ranks")
    return "\n".join(lines)
