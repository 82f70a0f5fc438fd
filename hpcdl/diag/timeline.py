"""--timeline FILE: every rank's events on one clock, in the Chrome trace event format.

Each rank writes its own buffer: the diagnostics thread moves new events from the ring into
`FILE.ranks/rank-R.bin` (RECORD, fixed-size binary: times in seconds since the clock
alignment) every DRAIN_S, beside `rank-R.json` (who: rank, host, node). A node leader with a
stager also samples the stager's cumulative counters (files copied, PFS fallbacks) every DRAIN_S
into `rank-R.counters.jsonl`: the trace shows them per node as rates, not one event per file.
The ring is large with a timeline (TIMELINE_EVENTS) so that a drain never falls a whole ring
behind; if it does, the gap is counted and shown as an instant event "lost N events".

The clock: at session start every rank leaves two barriers and takes perf_counter() as its
zero. Barrier exits are within tens of microseconds of each other on a node (more across
nodes: the skew of one barrier's fan-out), which is below a step's phases.

merge() (rank 0 at the end of a run, or `python -m hpcdl.report timeline DIR`) writes the
trace JSON that Perfetto (ui.perfetto.dev) and chrome://tracing open: one process per rank
("rank R (host)") with a thread for the training thread and one for gradient allreduces.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import numpy as np

from hpcdl.diag.events import RECORDER, Kind, Recorder, label

TIMELINE_EVENTS = 1 << 16  # ring size with --timeline: ~6 s of a 10,000-events/s rank
DRAIN_S = 1.0
RECORD = np.dtype([("kind", "<i4"), ("t0", "<f8"), ("t1", "<f8"), ("step", "<i8"), ("arg", "<i8")])
LOST = -1  # kind of a record that counts events lost between drains (arg)
INSTANT = frozenset({Kind.SIGNAL, Kind.STALL, Kind.FROZEN, LOST})
NODE_TRACK = 1_000_000  # trace pid of node N's counters: NODE_TRACK + N (ranks are 0..W-1)


def parts_dir(timeline: str | Path) -> Path:
    """Where the ranks' buffers of --timeline FILE go."""
    path = Path(timeline)
    return path.with_name(path.name + ".ranks")


class TimelineWriter:
    """One rank's buffer file; drain() is called by the diagnostics thread only."""

    def __init__(self, timeline: str, who: dict, t_zero: float, recorder: Recorder = RECORDER):
        self.folder = parts_dir(timeline)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.rank = rank = who["rank"]
        (self.folder / f"rank-{rank:05d}.json").write_text(json.dumps(who))
        self._file = open(self.folder / f"rank-{rank:05d}.bin", "wb")  # noqa: SIM115
        self.t_zero, self.recorder = t_zero, recorder
        self._next = 0  # the first ring event not yet written
        self._counters = None  # rank-R.counters.jsonl, opened at the first sample

    def drain(self) -> None:
        events, self._next, lost = self.recorder.since(self._next)
        rows = np.array(
            [(int(k), t0 - self.t_zero, t1 - self.t_zero, s, a) for k, t0, t1, s, a in events],
            RECORD,
        )
        if lost:
            t = rows["t0"][0] if len(rows) else 0.0
            rows = np.concatenate([np.array([(LOST, t, t, 0, lost)], RECORD), rows])
        rows.tofile(self._file)
        self._file.flush()

    def sample(self, name: str, values: dict[str, int], t: float) -> None:
        """One sample of a node's cumulative counters (the stager's), as a JSON line."""
        if self._counters is None:
            path = self.folder / f"rank-{self.rank:05d}.counters.jsonl"
            self._counters = open(path, "w")  # noqa: SIM115
        record = {"name": name, "t": t - self.t_zero, **values}
        self._counters.write(json.dumps(record) + "\n")
        self._counters.flush()

    def close(self) -> None:
        self.drain()
        self._file.close()
        if self._counters is not None:
            self._counters.close()


def read_parts(folder: str | Path) -> list[tuple[dict, np.ndarray]]:
    """Every rank's (who, records) in a FILE.ranks folder, by rank; who["counters"]: the
    counter samples the rank took for its node (node leaders with staging), oldest first."""
    folder = Path(folder)
    parts = []
    for meta in sorted(folder.glob("rank-*.json")):
        who = json.loads(meta.read_text())
        data = meta.with_suffix(".bin")
        records = np.fromfile(data, RECORD) if data.exists() else np.zeros(0, RECORD)
        samples = meta.with_suffix(".counters.jsonl")
        lines = samples.read_text().splitlines() if samples.exists() else []
        who["counters"] = [json.loads(line) for line in lines if line.endswith("}")]
        parts.append((who, records))
    if not parts:
        raise FileNotFoundError(f"{folder} holds no rank-R.json / rank-R.bin timeline buffers")
    return parts


def trace_events(parts: list[tuple[dict, np.ndarray]]) -> list[dict]:
    """Chrome trace events: metadata naming each rank's track, then every event (times in us)."""
    out: list[dict] = []
    for who, records in parts:
        pid = who["rank"]
        name = f"rank {pid} ({who['host']})"
        out.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}})
        order = {"sort_index": pid}
        out.append({"ph": "M", "name": "process_sort_index", "pid": pid, "args": order})
        for tid, thread in ((0, "training"), (1, "gradient allreduce")):
            out.append(
                {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": thread}}
            )
        for kind, t0, t1, step, arg in records.tolist():
            out.append(_event(pid, kind, t0, t1, step, arg))
        out += counter_events(who)
    return out


def counter_events(who: dict) -> list[dict]:
    """A node's track of rates from its cumulative counter samples: per second, between two
    samples (Chrome trace "C" events: Perfetto draws each name as a counter track)."""
    samples = who.get("counters", [])
    if not samples:
        return []
    pid = NODE_TRACK + who["node"]
    name = f"node {who['node']} ({who['host']}): {samples[0]['name']}"
    out: list[dict] = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}}]
    for before, now in zip(samples, samples[1:]):
        dt = max(now["t"] - before["t"], 1e-9)
        rates = {k: (now[k] - before[k]) / dt for k in now if k not in ("name", "t")}
        for key, rate in rates.items():
            out.append({"ph": "C", "name": f"{key}/s", "pid": pid, "ts": now["t"] * 1e6,
                        "args": {f"{key}/s": rate}})  # fmt: skip
    return out


def _event(pid: int, kind: int, t0: float, t1: float, step: int, arg: int) -> dict:
    tid = 1 if kind == Kind.ALLREDUCE else 0
    args: dict = {"step": step}
    if kind == Kind.ALLREDUCE:
        args["bytes"] = arg
    elif kind == Kind.SIGNAL:
        args["signal"] = arg
    elif kind == LOST:
        return {"ph": "i", "s": "p", "name": f"lost {arg} events", "pid": pid, "tid": 0,
                "ts": t0 * 1e6}  # fmt: skip
    name = label(kind)
    if kind in INSTANT:
        return {"ph": "i", "s": "p", "name": name, "pid": pid, "tid": tid, "ts": t0 * 1e6,
                "args": args}  # fmt: skip
    return {"ph": "X", "name": name, "pid": pid, "tid": tid, "ts": t0 * 1e6,
            "dur": max(0.0, t1 - t0) * 1e6, "args": args}  # fmt: skip


def merge(folder: str | Path, out: str | Path) -> int:
    """Write the Chrome trace of a FILE.ranks folder to out (atomically); returns the number of
    ranks merged."""
    parts = read_parts(folder)
    out = Path(out)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"traceEvents": trace_events(parts), "displayTimeUnit": "ms"}))
    os.replace(tmp, out)
    return len(parts)


def remove_parts(timeline: str | Path, ranks: int) -> None:
    """Remove the buffers the ranks wrote for --timeline FILE (after the merge), and their
    folder if nothing else is in it: only the files named rank-R.json / .bin, R < ranks."""
    folder = parts_dir(timeline)
    for rank in range(ranks):
        for suffix in (".json", ".bin", ".counters.jsonl"):
            (folder / f"rank-{rank:05d}{suffix}").unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        folder.rmdir()
