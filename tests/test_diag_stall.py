"""The stall inspector on 4 real ranks (mpirun --oversubscribe): a rank stopped with SIGSTOP is
named, with its host, by the ranks waiting for it; after SIGCONT training ends where an
unstopped run ends; with --stall-shutdown the job ends with exit status 5, leaves no process and
no heartbeat file behind, and the flight records of the waiting ranks say what happened."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
from helpers import job_pids, mpi_env, rank_pid, run_train, train_cmd, wait_until

from hpcdl import checkpoint
from hpcdl.diag import flight

RANKS = 4
STOPPED = 2
WARN_S = 2.0
SHUTDOWN_S = 2.0
TIMEOUT_S = 300


def flags(data: Path, out: Path) -> list:
    return [
        "--data", data / "train", "--model", "cnn", "--epochs", 4, "--batch-size", 16,
        "--workers", 0, "--seed", 3, "--quiet", "--checkpoint-dir", out / "ckpt",
        "--metrics", out / "m.jsonl", "--metrics-every", 1, "--stall-warning", WARN_S,
    ]  # fmt: skip


def steps_written(metrics: Path) -> int:
    try:
        return metrics.read_text().count('"event": "step"')
    except OSError:
        return 0


class Job:
    """A training job started in the background; its stderr lines with their arrival times."""

    def __init__(self, args: list, tmp_path: Path) -> None:
        self.marker = str(tmp_path)
        self.shm = tmp_path / "shm"
        self.shm.mkdir()
        env = dict(mpi_env(), HPCDL_TEST_MARKER=self.marker, HPCDL_SHM_DIR=str(self.shm))
        cmd = train_cmd(RANKS, *args)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env)  # fmt: skip
        self.lines: list[tuple[float, str]] = []
        self.out = ""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append((time.monotonic(), line))

    def wait_for_line(self, *words: str, timeout: float) -> float:
        """The time the first stderr line holding every word arrived."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for t, line in list(self.lines):
                if all(w in line for w in words):
                    return t
            time.sleep(0.05)
        raise AssertionError(f"no line with {words} in {timeout} s:\n{self.stderr}")

    def finish(self) -> int:
        self.out = self.proc.stdout.read()
        self.proc.wait(timeout=TIMEOUT_S)
        self._reader.join(timeout=10)
        return self.proc.returncode

    @property
    def stderr(self) -> str:
        return "".join(line for _, line in self.lines)

    def kill(self) -> None:
        for pid in job_pids(self.marker):
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass


def stop_rank_mid_run(job: Job, metrics: Path) -> tuple[int, float]:
    deadline = time.monotonic() + TIMEOUT_S
    while steps_written(metrics) < 6:
        assert job.proc.poll() is None and time.monotonic() < deadline, job.stderr
        time.sleep(0.02)
    pid = rank_pid(job.marker, STOPPED)
    os.kill(pid, signal.SIGSTOP)
    return pid, time.monotonic()


def final_params(ckpt_dir: Path) -> np.ndarray:
    return checkpoint.load(checkpoint.latest(ckpt_dir)).params


def test_sigstop_names_the_rank_and_host_and_sigcont_trains_on_to_the_same_parameters(
    digits_dir, tmp_path
):
    ref = run_train(RANKS, *flags(digits_dir, tmp_path / "ref"), timeout=TIMEOUT_S)
    assert ref.returncode == 0, ref.stdout + ref.stderr
    out = tmp_path / "stopped"
    job = Job(flags(digits_dir, out), tmp_path)
    try:
        pid, stopped_at = stop_rank_mid_run(job, out / "m.jsonl")
        host = socket.gethostname()
        named = job.wait_for_line("stall:", f"rank {STOPPED} on {host}", timeout=WARN_S + 5)
        assert named - stopped_at <= WARN_S + 5, job.stderr
        os.kill(pid, signal.SIGCONT)
        job.wait_for_line("stall over", timeout=30)
        status = job.finish()
    finally:
        job.kill()
    assert status == 0, job.out + job.stderr
    assert "no sign of life" in job.stderr, job.stderr
    assert f"this process (rank {STOPPED}) did not run for" in job.stderr, job.stderr
    stall_lines = [line for _, line in job.lines if "stall:" in line]
    assert len(stall_lines) == 1, job.stderr  # once per stall, from one rank
    assert np.array_equal(final_params(out / "ckpt"), final_params(tmp_path / "ref" / "ckpt"))


def test_sigstop_with_stall_shutdown_exits_5_in_time_and_leaves_nothing(digits_dir, tmp_path):
    out = tmp_path / "run"
    job = Job([*flags(digits_dir, out), "--stall-shutdown", SHUTDOWN_S], tmp_path)
    try:
        _, stopped_at = stop_rank_mid_run(job, out / "m.jsonl")
        status = job.finish()
        ended = time.monotonic()
    finally:
        job.kill()
    assert status == 5, job.out + job.stderr
    assert ended - stopped_at <= WARN_S + SHUTDOWN_S + 10, job.stderr
    assert "--stall-shutdown" in job.stderr and "exit status 5" in job.stderr, job.stderr
    wait_until(lambda: not job_pids(job.marker), 10, "the job's processes gone")
    assert list(job.shm.iterdir()) == []  # no heartbeat table left
    records = flight.read_records(out / "ckpt")
    assert {r["rank"] for r in records} == set(range(RANKS)) - {STOPPED}, records
    assert all("stall shutdown" in r["reason"] for r in records)
    assert all(r["waiting"] and r["events"] for r in records)
    report = subprocess.run(
        [sys.executable, "-m", "hpcdl.report", "last", str(out / "ckpt")],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert f"no record from rank(s) {STOPPED}" in report.stdout, report.stdout
