"""The stall inspector across emulated nodes (tools.bench.cluster): 2 nodes x 2 ranks.

The ranks of node 1 cannot read node 2's heartbeat table; they ask node 2 (hpcdl.diag.remote).
First rank 3 is stopped (SIGSTOP): rank 0's line names it, from the answer of rank 2, its
neighbour. Then both ranks of node 2 are stopped: nobody there answers, and rank 0's line names
the node. After SIGCONT each time, training goes on and the job ends normally: both stops fall
in epoch 0 (22 steps; the second after step 9 or so), so 3 epochs leave it 2 to go on in (each
1.5 s; 8 epochs spent 11 s of CI's time on the rest)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import mpi_env

pytestmark = pytest.mark.multinode

WARN_S = 2.0


def rank_pids(cluster, node: int) -> dict[int, int]:
    """{world rank: pid} of the training ranks in an emulated node."""
    found = {}
    for pid in cluster.pids(node):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read().split(b"\0")
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"hpcdl.train" not in f.read():
                    continue
        except OSError:
            continue
        for item in environ:
            if item.startswith(b"OMPI_COMM_WORLD_RANK="):
                found[int(item.split(b"=")[1])] = pid
    return found


def test_ranks_on_another_node_are_named_stopped_one_or_all(cluster, digits_dir, tmp_path):
    metrics = tmp_path / "m.jsonl"
    program = [sys.executable, "-m", "hpcdl.train", "--data", digits_dir / "train", "--model",
               "cnn", "--epochs", 3, "--batch-size", 16, "--workers", 0, "--progress", "none",
               "--metrics", metrics, "--metrics-every", 1, "--stall-warning", WARN_S]  # fmt: skip
    command = cluster.argv(1, cluster.mpirun([2, 2], *map(str, program)))
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=mpi_env())  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(job.stderr), daemon=True)
    reader.start()

    def wait_for(*words: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [line for line in list(lines) if all(w in line for w in words)]
            if found:
                return found[0]
            time.sleep(0.05)
        raise AssertionError(f"no line with {words}:\n{''.join(lines)}")

    def steps() -> int:
        return metrics.read_text().count('"step"') if metrics.exists() else 0

    try:
        deadline = time.monotonic() + 180
        while steps() < 6:
            assert job.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.02)
        pids = rank_pids(cluster, 2)
        assert sorted(pids) == [2, 3], pids
        os.kill(pids[3], signal.SIGSTOP)
        line = wait_for("rank 0: warning: stall:", "rank 3 on vnode2", timeout=WARN_S + 5)
        assert "no sign of life" in line, line
        os.kill(pids[3], signal.SIGCONT)
        wait_for("rank 0: warning: stall over", timeout=30)
        at = steps()
        while steps() < at + 3:
            assert job.poll() is None, "".join(lines)
            time.sleep(0.02)
        for pid in pids.values():
            os.kill(pid, signal.SIGSTOP)
        line = wait_for("node vnode2 (ranks 2, 3) did not answer", timeout=WARN_S + 5)
        assert line.startswith("hpcdl: rank 0: warning: stall:"), line
        for pid in pids.values():
            os.kill(pid, signal.SIGCONT)
        out = job.stdout.read()
        job.wait(timeout=180)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    reader.join(timeout=10)
    assert job.returncode == 0, out + "".join(lines)
    assert "final train loss" in out
    print("".join(lines))  # shown with -s: docs/diagnose.md quotes it
    assert Path(metrics).exists()


def test_node_watch_connects_by_address_when_names_do_not_resolve(digits_dir, tmp_path):
    """Issue 36, deliverable 5: no 30 s start-up hold and no `node watch off`; a killed node
    is named."""
    from tools.bench.cluster import Cluster, leftovers, unavailable

    reason = unavailable()
    if reason:
        pytest.skip(reason)
    with Cluster(tmp_path / "cluster", nodes=2, resolve=False) as cluster:
        probe = subprocess.run(cluster.argv(1, "getent hosts vnode2"), capture_output=True)
        assert probe.returncode != 0  # the names really do not resolve
        metrics = tmp_path / "m.jsonl"
        program = [sys.executable, "-m", "hpcdl.train", "--data", digits_dir / "train",
                   "--model", "cnn", "--epochs", 20, "--batch-size", 16, "--workers", 0,
                   "--progress", "none", "--metrics", metrics, "--metrics-every", 1]  # fmt: skip
        command = cluster.argv(1, cluster.mpirun([1, 1], *map(str, program)))
        with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=mpi_env()) as job:  # fmt: skip
            deadline = time.monotonic() + 180
            while not metrics.exists() or metrics.read_text().count('"step"') < 3:
                assert job.poll() is None and time.monotonic() < deadline, job.communicate()
                time.sleep(0.05)
            for pid in cluster.pids(2):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            out, err = job.communicate(timeout=60)
    assert not leftovers(), leftovers()
    assert "node watch off" not in out + err, out + err
    assert "hpcdl: node vnode2 (ranks 1) was lost" in out + err, out + err


def test_a_cut_link_is_named_by_the_waiting_ranks_and_the_job_ends(cluster, digits_dir, tmp_path):
    """Issue 36, deliverable 5: with node 2's link cut (its processes alive) the job printed
    nothing and hung. Now rank 0's stall line names the node, and the node watch ends the job."""
    metrics = tmp_path / "m.jsonl"
    program = [sys.executable, "-m", "hpcdl.train", "--data", digits_dir / "train", "--model",
               "cnn", "--epochs", 20, "--batch-size", 16, "--workers", 0, "--progress", "none",
               "--metrics", metrics, "--metrics-every", 1, "--stall-warning", WARN_S]  # fmt: skip
    command = cluster.argv(1, cluster.mpirun([2, 2], *map(str, program)))
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=mpi_env())  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(job.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 180
        while not metrics.exists() or metrics.read_text().count('"step"') < 6:
            assert job.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.02)
        subprocess.run(["ip", "-n", cluster.switch, "link", "set", "p2", "down"], check=True)
        job.wait(timeout=120)  # no hang
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
        reader.join(timeout=10)
    output = "".join(lines)
    stall = [line for line in lines if line.startswith("hpcdl: rank 0: warning: stall:")]
    assert stall and "node vnode2 (ranks 2, 3) did not answer" in stall[0], output
    assert "hpcdl: node vnode2 (ranks 2, 3) was lost: it stopped answering" in output, output
    assert job.returncode != 0
