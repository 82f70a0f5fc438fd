"""hpcdl.diag without MPI: the event ring, the heartbeat slot, flight records and their report,
the stall inspector's reading of a heartbeat table, and the timeline's trace format."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from helpers import wait_until

from hpcdl.diag import flight, timeline
from hpcdl.diag.events import (
    ALIVE,
    LAST_END,
    LAST_KIND,
    SINCE,
    SLOT_FIELDS,
    STATE,
    STEP,
    Kind,
    Recorder,
)
from hpcdl.diag.heartbeat import ages
from hpcdl.diag.stall import STALE_S, StallInspector


def test_the_ring_keeps_the_newest_events_in_order():
    ring = Recorder(capacity=5)
    for i in range(12):
        ring.begin_step(i)
        ring.record(Kind.FORWARD, float(i), i + 0.5)
    assert [e[3] for e in ring.last(100)] == [7, 8, 9, 10, 11]
    assert [e[3] for e in ring.last(2)] == [10, 11]
    events, next_start, lost = ring.since(3)
    assert (next_start, lost) == (12, 4) and [e[3] for e in events] == [7, 8, 9, 10, 11]


def test_two_threads_recording_at_once_lose_no_event():
    ring = Recorder(capacity=100_000)

    def record(kind):
        for i in range(20_000):
            ring.record_aside(kind, float(i), float(i))

    threads = [threading.Thread(target=record, args=(k,)) for k in (Kind.ALLREDUCE, Kind.SYNC)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    events = ring.last(100_000)
    assert ring.recorded == 40_000 and len(events) == 40_000
    assert sum(e[0] == Kind.ALLREDUCE for e in events) == 20_000


def test_a_wait_shows_in_the_slot_while_it_lasts_and_not_after():
    ring = Recorder()
    seen = {}
    with ring.span(Kind.COMM_WAIT):
        seen["inside"] = (ring.slot[STATE], ring.slot[SINCE])
    assert seen["inside"][0] == Kind.COMM_WAIT and seen["inside"][1] > 0
    assert ring.slot[STATE] == 0 and ring.slot[LAST_KIND] == Kind.COMM_WAIT
    with ring.span(Kind.EVAL):  # not a wait: the slot keeps saying "running"
        assert ring.slot[STATE] == 0


def write_records(directory, run, states):
    """Flight records of ranks 0..n-1 of one run; states[r] = (waiting kind or None, last)."""
    for rank, (waiting, last) in enumerate(states):
        ring = Recorder()
        ring.begin_step(7)
        ring.record(Kind.FORWARD, 1.0, 1.1)
        ring.record(last, 1.1, 1.2)
        if waiting:
            ring.enter(waiting)
        flight.PLAN.directory, flight.PLAN.rank, flight.PLAN.run_id = directory, rank, run
        flight.PLAN.world_size, flight.PLAN.dumped = len(states) + 1, False
        assert flight.dump("SIGTERM", ring) == directory / "flight" / f"rank-{rank:05d}.json"


@pytest.fixture
def plan():
    saved = flight.FlightPlan(**vars(flight.PLAN))
    yield flight.PLAN
    for key, value in vars(saved).items():
        setattr(flight.PLAN, key, value)


def test_report_last_marks_the_rank_that_differs_and_names_the_missing_one(tmp_path, plan):
    write_records(tmp_path, 1.0, [(Kind.COMM_WAIT, Kind.BACKWARD)] * 3)  # an earlier run
    write_records(tmp_path, 2.0, [(Kind.COMM_WAIT, Kind.BACKWARD), (None, Kind.FORWARD),
                                  (Kind.COMM_WAIT, Kind.BACKWARD)])  # fmt: skip
    records = flight.read_records(tmp_path)
    assert [r["run"] for r in records] == [2.0] * 3
    assert records[0]["waiting"] == "gradient allreduce wait" and records[1]["waiting"] is None
    result = subprocess.run([sys.executable, "-m", "hpcdl.report", "last", str(tmp_path)],
                            capture_output=True, text=True, check=True)  # fmt: skip
    head = result.stdout.splitlines()[0]
    assert "*rank 1" in head and "*rank 0" not in head and "*rank 2" not in head, result.stdout
    assert "no record from rank(s) 3" in result.stdout, result.stdout
    assert "backward s7" in result.stdout


def test_a_process_dumps_once_and_not_without_a_directory(tmp_path, plan):
    plan.directory, plan.dumped = None, False
    assert flight.dump("no place") is None
    plan.directory = tmp_path
    assert flight.dump("first") is not None and flight.dump("second") is None
    assert json.loads((tmp_path / "flight" / "rank-00000.json").read_text())["reason"] == "first"


def test_report_last_on_a_directory_without_records_says_what_to_do(tmp_path):
    result = subprocess.run([sys.executable, "-m", "hpcdl.report", "last", str(tmp_path)],
                            capture_output=True, text=True)  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and "holds no flight record" in result.stderr


class Table:
    """A node's heartbeat table as the inspector reads it (the shared file: test_diag_stall)."""

    def __init__(self, rows: int) -> None:
        self.rows = np.zeros((rows, SLOT_FIELDS))

    def snapshot(self) -> np.ndarray:
        return self.rows.copy()


def row(table, local, step, state, since, alive, last=Kind.BACKWARD, last_end=0.0):
    table.rows[local, [STEP, STATE, SINCE, ALIVE, LAST_KIND, LAST_END]] = (
        step, state, since, alive, last, last_end)  # fmt: skip


def test_the_inspector_names_silent_busy_and_late_ranks_and_warns_once(capsys):
    now = 1000.0
    table = Table(4)
    ring = Recorder()
    ring.bind_slot(table.rows[0])
    aborted = []
    inspector = StallInspector(table, (0, 1, 2, 3), 0, "nodeA", 5.0, None, aborted.append, ring)
    row(table, 0, 9, Kind.COMM_WAIT, now - 6, now)
    row(table, 1, 9, 0, now - 6, now - STALE_S - 1)  # silent
    row(table, 2, 9, 0, now - 6, now)  # alive, busy
    row(table, 3, 8, Kind.DATA_WAIT, now - 7, now)  # still waiting for its batch
    inspector.check(now)
    inspector.check(now + 0.25)
    err = capsys.readouterr().err
    assert err.count("stall:") == 1, err
    assert "rank 1 on nodeA: no sign of life" in err
    assert "rank 2 on nodeA: busy, not waiting" in err
    assert "rank 3 on nodeA: in data wait" in err and "at step 8" in err
    ring.record(Kind.COMM_WAIT, now - 6, now + 1)  # the wait ends
    inspector.check(now + 1.25)
    assert "stall over" in capsys.readouterr().err
    assert aborted == []


def test_only_the_lowest_waiting_rank_prints_and_shutdown_aborts_with_5(capsys, monkeypatch):
    monkeypatch.setattr("hpcdl.diag.stall.GRACE_S", 0.0)
    now = 50.0
    table = Table(3)
    rings = [Recorder() for _ in range(3)]
    for local, ring in enumerate(rings):
        ring.bind_slot(table.rows[local])
    row(table, 0, 3, Kind.COMM_WAIT, now - 2.5, now)
    row(table, 1, 3, Kind.COMM_WAIT, now - 2.5, now)
    row(table, 2, 3, Kind.COMM_WAIT, now - 9, now - 9)  # stopped inside the allreduce
    aborted = []
    second = StallInspector(table, (0, 1, 2), 1, "h", 2.0, 1.0, aborted.append, rings[1])
    second.check(now)
    assert "stall:" not in capsys.readouterr().err  # rank 0 prints it
    first = StallInspector(table, (0, 1, 2), 0, "h", 2.0, 1.0, aborted.append, rings[0])
    first.check(now)
    assert "not arrived: rank 2 on h: no sign of life" in capsys.readouterr().err
    assert aborted == []
    first.check(now + 0.5)  # --stall-warning 2 + --stall-shutdown 1
    assert aborted == [5] and "exit status 5" in capsys.readouterr().err


def test_a_process_that_was_stopped_says_so_and_does_not_call_its_wait_a_stall(capsys):
    table = Table(2)
    ring = Recorder()
    ring.bind_slot(table.rows[1])
    inspector = StallInspector(table, (0, 1), 1, "h", 2.0, 1.0, lambda code: None, ring)
    ring.enter(Kind.COMM_WAIT)
    inspector.check(time.perf_counter() + 30)  # 30 s without a check: this process was stopped
    err = capsys.readouterr().err
    assert "this process (rank 1) did not run for" in err and "stall:" not in err
    assert ring.last(1)[0][0] == Kind.FROZEN


def test_timeline_buffers_merge_into_a_chrome_trace(tmp_path):
    ring = Recorder(capacity=64)
    trace = tmp_path / "trace.json"
    writers = []
    for rank in range(2):
        who = {"rank": rank, "host": "h", "node": 0, "world_size": 2}
        writers.append(timeline.TimelineWriter(str(trace), who, 100.0, ring))
    ring.record(Kind.FORWARD, 100.5, 100.75)
    ring.record_aside(Kind.ALLREDUCE, 100.75, 101.0, 4096)
    writers[0].drain()
    writers[0].sample("stager", {"copies": 0, "pfs_fallbacks": 0}, 100.0)
    writers[0].sample("stager", {"copies": 50, "pfs_fallbacks": 2}, 102.0)
    for i in range(70):  # more than the ring holds between two drains
        ring.record(Kind.OPTIMIZER, 101.0 + i, 101.0 + i)
    for w in writers:
        w.close()
    assert timeline.merge(timeline.parts_dir(trace), trace) == 2
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {"rank 0 (h)", "rank 1 (h)", "node 0 (h): stager"}
    forward = next(e for e in events if e["name"] == "forward" and e["pid"] == 0)
    assert (forward["ts"], forward["dur"], forward["ph"]) == (500_000.0, 250_000.0, "X")
    allreduce = next(e for e in events if e["name"] == "allreduce" and e["pid"] == 0)
    assert allreduce["tid"] == 1 and allreduce["args"]["bytes"] == 4096
    assert any(e["name"] == "lost 6 events" for e in events if e["pid"] == 0)
    rates = [e for e in events if e["ph"] == "C"]
    assert {e["name"]: e["args"] for e in rates} == {
        "copies/s": {"copies/s": 25.0},
        "pfs_fallbacks/s": {"pfs_fallbacks/s": 1.0},
    }
    assert {e["pid"] for e in rates} == {timeline.NODE_TRACK}
    assert any(e["name"] == "lost 8 events" for e in events if e["pid"] == 1)
    timeline.remove_parts(trace, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.json"]  # buffers removed


class Answers:
    """Other nodes' answers as hpcdl.diag.remote.NodeQuestions.ask gives them."""

    def __init__(self, answers) -> None:
        self.answers, self.asked = answers, 0

    def ask(self):
        self.asked += 1
        return self.answers


def test_when_every_local_rank_waits_the_inspector_asks_the_other_nodes(capsys):
    now = 500.0
    table = Table(2)
    ring = Recorder()
    ring.bind_slot(table.rows[0])
    row(table, 0, 4, Kind.COMM_WAIT, now - 3, now)
    row(table, 1, 4, Kind.COMM_WAIT, now - 3, now)
    waiting_b = ages(np.array([table.rows[0]]), now)[0]
    stopped_b = waiting_b.copy()
    stopped_b[3] = 4.0  # ALIVE_AGE: no stamp for 4 s
    remote = Answers([("nodeB", (2, 3), np.array([waiting_b, stopped_b])),
                      ("nodeC", (4, 5), None)])  # fmt: skip
    inspector = StallInspector(table, (0, 1), 0, "nodeA", 1.0, None, print, ring, remote)
    inspector.check(now - 3 + 1.5)  # past --stall-warning, within STALE_S: wait for a picture
    assert remote.asked == 0 and "stall:" not in capsys.readouterr().err
    inspector.check(now)
    err = capsys.readouterr().err
    assert remote.asked == 1 and err.count("stall:") == 1, err
    assert "rank 3 on nodeB: no sign of life for 4.0 s" in err and "rank 2 on" not in err
    assert "node nodeC (ranks 4, 5) did not answer" in err


class OneRank:
    """A communicator of one rank with the methods a diagnostics session uses (hpcdl.torch's
    stand-in for torch.distributed has the same)."""

    def Get_rank(self):  # noqa: N802 (mpi4py spelling)
        return 0

    def Get_size(self):  # noqa: N802
        return 1

    def bcast(self, obj, root=0):
        return obj

    def allgather(self, obj):
        return [obj]

    def Barrier(self):  # noqa: N802
        pass


def test_a_session_without_mpi_writes_its_timeline_and_leaves_no_heartbeat_file(
    tmp_path, monkeypatch, plan
):
    from hpcdl import diag

    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setenv("HPCDL_SHM_DIR", str(shm))
    trace = tmp_path / "t.json"
    options = diag.DiagOptions(timeline=str(trace), run_dir=str(tmp_path), quiet=True)
    session = diag.DiagSession.open(OneRank(), OneRank(), options)
    try:
        assert list(shm.iterdir()) == []  # unlinked once mapped
        assert session.inspector is not None and session.remote is None
        with diag.span(diag.Kind.OPTIMIZER):
            pass  # the span is recorded however short it is: its name is what is checked
    finally:
        session.close()
    names = [e["name"] for e in json.loads(trace.read_text())["traceEvents"]]
    assert names[-1] == "optimizer"
    assert diag.RECORDER.slot.flags.owndata  # no longer a view of the unmapped table


def test_diag_is_a_base_layer_package():
    """hpcdl.diag imports the standard library, numpy, hpcdl.messages, hpcdl.mpi_threads,
    hpcdl.mpi_errors (all base layer) and itself only (mpi4py inside functions, for what needs
    MPI); everything else calls into it."""
    import ast
    from pathlib import Path

    package = Path(__file__).resolve().parents[1] / "hpcdl" / "diag"
    imported = set()
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [f"{node.module}.{a.name}" for a in node.names]
                imported |= set(names) if node.module == "hpcdl" else {node.module}

    def allowed(module: str) -> bool:
        top = module.split(".")[0]
        if top == "hpcdl":
            return module.split(".")[1] in ("messages", "mpi_threads", "mpi_errors", "diag")
        return top in sys.stdlib_module_names or top in ("numpy", "mpi4py")

    assert [m for m in sorted(imported) if not allowed(m)] == []


def test_a_wait_on_a_helper_thread_is_not_the_ranks_wait():
    ring = Recorder()
    seen = []

    def prefetch():
        with ring.span(Kind.DATA_WAIT):
            seen.append(ring.slot[STATE])

    helper = threading.Thread(target=prefetch)
    helper.start()
    helper.join()
    assert seen == [0] and ring.recorded == 0


def test_the_kernel_says_whether_a_silent_rank_is_stopped_or_gone():
    import os
    import signal

    from hpcdl.diag.heartbeat import process_state

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        os.kill(child.pid, signal.SIGSTOP)
        wait_until(lambda: process_state(child.pid) == "T", 10, "the child stopped")
        assert process_state(os.getpid()) in "RS"
    finally:
        child.kill()
        child.wait()
    assert process_state(child.pid) == "X" and process_state(0) == "\0"


def test_a_hundred_ranks_in_one_state_read_as_one_column():
    def record(rank, waiting, last):
        events = [["forward", 41, 62.0, 0.01, 0], [last, 41, 61.0 + rank / 1e3, 0.02, 0]]
        return {"rank": rank, "host": f"n{rank // 8}", "reason": "stall shutdown", "run": 1.0,
                "step": 41, "waiting": waiting, "waiting_s": 61.0 + rank / 100,
                "world_size": 101, "events": events}  # fmt: skip

    records = [record(r, "gradient allreduce wait", "backward") for r in range(100) if r != 37]
    records.append(record(37, None, "forward"))
    text = flight.side_by_side(sorted(records, key=lambda r: r["rank"]))
    head = text.splitlines()[0]
    assert head.split() == ["ranks", "0-36,", "38-99", "(13", "hosts)", "*rank", "37", "(n4)"]
    assert "no record from rank(s) 100:" in text
