"""hpcdl.diag in real training runs (2 ranks under mpirun): --timeline's trace, the timeline
report of buffers left behind, and flight records on an exception and a signal stop."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers import mpi_env, mpirun_cmd, rank_pid, run_train, train_cmd

from hpcdl.diag import flight, timeline

TESTS = Path(__file__).resolve().parent
TIMEOUT_S = 240


def base_flags(data: Path, out: Path) -> list:
    return [
        "--data", data / "train", "--val-data", data / "val", "--model", "mlp", "--epochs", 2,
        "--batch-size", 32, "--workers", 1, "--quiet", "--checkpoint-dir", out / "ckpt",
    ]  # fmt: skip


def test_timeline_has_every_ranks_phases_and_each_buckets_allreduce(digits_dir, tmp_path):
    trace = tmp_path / "trace.json"
    args = [*base_flags(digits_dir, tmp_path), "--timeline", trace, "--bucket-mb", 0.05,
            "--stage-dir", tmp_path / "stage"]  # fmt: skip
    result = run_train(2, *args, timeout=TIMEOUT_S)
    assert result.returncode == 0, result.stdout + result.stderr
    events = json.loads(trace.read_text())["traceEvents"]
    assert not trace.with_name("trace.json.ranks").exists()  # merged, buffers removed
    for rank in (0, 1):
        names = {e["name"] for e in events if e.get("pid") == rank and e["ph"] != "M"}
        for phase in ("data wait", "forward", "backward", "gradient allreduce wait",
                      "optimizer", "evaluation", "checkpoint", "allreduce"):  # fmt: skip
            assert phase in names, (rank, names)
        buckets = [e for e in events if e.get("pid") == rank and e["name"] == "allreduce"]
        steps = {e["args"]["step"] for e in buckets}
        assert len(buckets) > len(steps) > 1  # several buckets per step, on the comm thread
        assert {e["tid"] for e in buckets} == {1} and all(e["args"]["bytes"] > 0 for e in buckets)
    stager = [e for e in events if e["ph"] == "C" and e["name"] == "copies/s"]
    assert stager and {e["pid"] for e in stager} == {timeline.NODE_TRACK}  # one node, as rates
    # one clock: the same step's allreduce of a bucket overlaps on both ranks
    first = [next(e for e in events if e.get("pid") == r and e["name"] == "allreduce")
             for r in (0, 1)]  # fmt: skip
    assert first[0]["args"]["step"] == first[1]["args"]["step"]
    ends = [e["ts"] + e["dur"] for e in first]
    assert abs(ends[0] - ends[1]) < 50_000, first  # within 50 ms (a loaded 2-core machine)
    png = tmp_path / "steps.png"
    report = subprocess.run(
        [sys.executable, "-m", "hpcdl.report", "timeline", str(trace), "--png", str(png)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert report.returncode == 0 and "wrote" in report.stdout, report.stderr
    assert png.stat().st_size > 10_000


def test_report_timeline_merges_buffers_left_by_a_stopped_run_and_draws_steps(digits_dir, tmp_path):
    trace = tmp_path / "t.json"
    env = dict(mpi_env())
    job = subprocess.Popen(
        train_cmd(2, *base_flags(digits_dir, tmp_path), "--epochs", 50, "--timeline", trace),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    buffer = tmp_path / "t.json.ranks" / "rank-00001.bin"
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not buffer.exists() or buffer.stat().st_size < 40 * 200:  # 200 events drained
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()
            time.sleep(0.1)
    finally:
        job.kill()  # mpirun killed: no merge at the end
        job.communicate()
    png = tmp_path / "steps.png"
    result = subprocess.run(
        [sys.executable, "-m", "hpcdl.report", "timeline", str(tmp_path), "--png", str(png)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "wrote" in result.stdout and png.stat().st_size > 10_000
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}


def test_an_exception_on_one_rank_leaves_every_ranks_flight_record(digits_dir, tmp_path):
    cmd = [*mpirun_cmd(2), sys.executable, TESTS / "raise_in_model.py", 5, 1, "--"]
    cmd += base_flags(digits_dir, tmp_path)
    result = subprocess.run([str(c) for c in cmd], capture_output=True, text=True,
                            env=mpi_env(), timeout=TIMEOUT_S)  # fmt: skip
    assert result.returncode == 1, result.stderr
    records = flight.read_records(tmp_path / "ckpt")
    reasons = {r["rank"]: r["reason"] for r in records}
    assert reasons[1].startswith("ModelBug: model bug at step 5"), reasons
    assert reasons.get(0) == "rank 1 failed", reasons
    assert records[0]["waiting"] is not None  # rank 0 waited for rank 1 in a collective


def test_a_signal_stop_leaves_every_ranks_flight_record(digits_dir, tmp_path):
    metrics = tmp_path / "m.jsonl"
    args = [*base_flags(digits_dir, tmp_path), "--epochs", 50, "--metrics", metrics]
    env = dict(mpi_env(), HPCDL_TEST_MARKER=str(tmp_path))
    job = subprocess.Popen(train_cmd(2, *args, "--metrics-every", 1), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not metrics.exists() or metrics.read_text().count('"step"') < 5:
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()
            time.sleep(0.05)
        os.kill(rank_pid(str(tmp_path), 1), signal.SIGTERM)  # Slurm's time limit, say
        out, err = job.communicate(timeout=TIMEOUT_S)
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
    assert job.returncode == 3, out + err
    records = flight.read_records(tmp_path / "ckpt")
    assert [r["reason"] for r in records] == ["stopped by signal SIGTERM"] * 2
    assert any(e[0] == "signal" for e in records[1]["events"])  # where it arrived
    assert any(e[0] == "checkpoint" for e in records[0]["events"])
