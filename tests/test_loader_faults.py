"""Loader faults in a real training job: each ends in one clear line (or a checkpoint), no hang.

Every test starts `mpirun -np 2 python -m hpcdl.train` on real HDF5 shards, breaks something under
it once training is under way (stops or kills a loader worker, truncates a shard, signals the
ranks) and checks the exit status, stderr and what was written. A hang fails the test through
the timeout of `communicate`.
"""

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import mpi_env, read_events, train_cmd

from hpcdl import checkpoint
from hpcdl.data.slots import free_bytes, shm_dir

TIMEOUT_S = 180  # generous: the machine running the tests may be loaded
LONG_RUN = ["--model", "mlp", "--epochs", 1000, "--batch-size", 16, "--seed", 3]


def error_lines(stderr: str) -> list[str]:
    """hpcdl's error lines, without Open MPI's framed reports."""
    return [line for line in stderr.splitlines() if line.startswith("hpcdl") and "error" in line]


def assert_no_crash_dump(stderr: str) -> None:
    for text in ("Traceback", "Fatal Python error", "Bus error", "Segmentation fault"):
        assert text not in stderr, stderr[-4000:]


def start_job(tmp_path: Path, *args) -> tuple[subprocess.Popen, Path]:
    metrics = tmp_path / "metrics.jsonl"
    cmd = train_cmd(2, *args, "--metrics", metrics, "--metrics-every", 1, "--quiet")
    job = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=mpi_env()
    )
    return job, metrics


def steps_done(metrics: Path) -> int:
    try:
        return len(read_events(metrics, "step"))
    except (OSError, ValueError):  # not created yet, or a line half written
        return 0


def wait_for_steps(job: subprocess.Popen, metrics: Path, n: int) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while steps_done(metrics) < n:
        assert job.poll() is None, job.communicate()
        assert time.monotonic() < deadline, "training did not start"
        time.sleep(0.05)


def wait_until_steps_stop(metrics: Path, quiet_s: float = 3.0) -> None:
    """Return once no step has been logged for quiet_s: the job waits on the stalled worker."""
    deadline = time.monotonic() + TIMEOUT_S
    last, since = steps_done(metrics), time.monotonic()
    while time.monotonic() - since < quiet_s:
        assert time.monotonic() < deadline, "the job never stalled"
        time.sleep(0.1)
        now = steps_done(metrics)
        if now != last:
            last, since = now, time.monotonic()


def _proc_children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(p.name))
    return kids


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def rank_and_worker_pids(marker: str) -> tuple[dict[int, int], dict[int, list[int]]]:
    """({rank: pid}, {rank: loader worker pids}) of the job whose command line holds marker."""
    ranks: dict[int, int] = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        cmd = _cmdline(int(p.name))
        if b"hpcdl.train" not in cmd or marker.encode() not in cmd:
            continue
        try:
            environ = (p / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for kv in environ:
            if kv.startswith(b"OMPI_COMM_WORLD_RANK="):
                ranks[int(kv.split(b"=")[1])] = int(p.name)
    kids = _proc_children()
    workers = {
        r: [c for c in kids.get(pid, []) if b"hpcdl.data.worker" in _cmdline(c)]
        for r, pid in ranks.items()
    }
    return ranks, workers


def kill_quietly(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture
def shards(digits_dir, tmp_path) -> Path:
    """A private copy of the digits training shards (tests change them)."""
    root = tmp_path / "train"
    shutil.copytree(digits_dir / "train", root)
    return root


# --- a worker that stops answering ------------------------------------------------------------


def test_stalled_worker_warns_then_ends_the_job_with_one_line_and_status_4(shards, tmp_path):
    job, metrics = start_job(
        tmp_path, "--data", shards, *LONG_RUN, "--workers", 1, "--loader-timeout", 6
    )
    stalled = []
    try:
        wait_for_steps(job, metrics, 5)
        _, workers = rank_and_worker_pids(str(shards))
        stalled = workers[1]
        assert len(stalled) == 1, workers
        os.kill(stalled[0], signal.SIGSTOP)
        out, err = job.communicate(timeout=TIMEOUT_S)
    finally:
        job.kill()
        kill_quietly(stalled)
    assert job.returncode == 4, err[-4000:]
    pid = stalled[0]
    assert "RuntimeWarning" not in err and "pool.py" not in err, err[-4000:]  # Python's format
    warnings = [line for line in err.splitlines() if line.startswith("hpcdl: rank 1: warning: ")]
    assert len(warnings) == 1, err[-4000:]
    assert f"loader worker pid {pid} has not answered for 3 s while building batch" in warnings[0]
    assert "stopped" in warnings[0]  # its process state: the user sees why
    lines = error_lines(err)
    assert len(lines) == 1, err[-4000:]
    assert f"loader worker pid {pid} has not answered for 6 s" in lines[0], lines[0]
    assert lines[0].startswith("hpcdl: rank 1: error: ") and "--loader-timeout" in lines[0]
    assert_no_crash_dump(err)
    assert "final" not in out


# --- Slurm's time limit while the trainer waits for a batch -----------------------------------


def test_sigterm_while_a_worker_is_stalled_still_checkpoints_and_exits_3(shards, tmp_path):
    ckpt_dir = tmp_path / "ckpt"
    job, metrics = start_job(
        tmp_path,
        "--data",
        shards,
        *LONG_RUN,
        "--workers",
        1,
        "--loader-timeout",
        600,
        "--checkpoint-dir",
        ckpt_dir,
    )
    stalled = []
    try:
        wait_for_steps(job, metrics, 5)
        ranks, workers = rank_and_worker_pids(str(shards))
        stalled = workers[1]
        os.kill(stalled[0], signal.SIGSTOP)
        wait_until_steps_stop(metrics)  # rank 1 waits for its batch, rank 0 in the allreduce
        for pid in ranks.values():  # as Slurm does: every task gets the signal
            os.kill(pid, signal.SIGTERM)
        out, err = job.communicate(timeout=TIMEOUT_S)
    finally:
        job.kill()
        kill_quietly(stalled)
    assert job.returncode == 3, err[-4000:]
    assert "hpcdl.train: stopped by signal SIGTERM, checkpoint at" in out, out + err[-4000:]
    saved = checkpoint.latest(ckpt_dir)
    assert saved is not None
    # The step that waited was completed (its batch built in the training process) and saved.
    assert checkpoint.load(saved).global_step == steps_done(metrics)
    assert read_events(metrics, "summary")[0]["stopped_by_signal"] is True
    assert_no_crash_dump(err)


# --- a shard that shrinks under the readers ---------------------------------------------------


@pytest.mark.parametrize("workers", [1, 0])
def test_shard_truncated_mid_run_gives_one_line_naming_the_file(shards, workers, tmp_path):
    job, metrics = start_job(tmp_path, "--data", shards, *LONG_RUN, "--workers", workers)
    victim = shards / "part-00001.h5"
    try:
        wait_for_steps(job, metrics, 5)
        os.truncate(victim, victim.stat().st_size // 2)
        out, err = job.communicate(timeout=TIMEOUT_S)
    finally:
        job.kill()
    assert job.returncode == 1, err[-4000:]  # a data error mid-run
    lines = error_lines(err)
    assert len(lines) == 1, err[-4000:]
    assert f"in {victim} cannot be read" in lines[0], lines[0]
    assert "--skip-bad-samples" in lines[0], lines[0]
    assert "was truncated or changed" in lines[0], lines[0]
    assert_no_crash_dump(err)
    assert "final" not in out


# --- a killed worker, and shared memory that is too small -------------------------------------


def test_killed_worker_gives_one_line_without_a_traceback(shards, tmp_path):
    job, metrics = start_job(tmp_path, "--data", shards, *LONG_RUN, "--workers", 1)
    try:
        wait_for_steps(job, metrics, 5)
        _, workers = rank_and_worker_pids(str(shards))
        victim = workers[1][0]
        os.kill(victim, signal.SIGKILL)
        out, err = job.communicate(timeout=TIMEOUT_S)
    finally:
        job.kill()
    assert job.returncode == 2, err[-4000:]
    lines = error_lines(err)
    assert len(lines) == 1, err[-4000:]
    assert lines[0].startswith("hpcdl: rank 1: error: "), lines[0]
    assert f"loader worker pid {victim} died (killed by SIGKILL)" in lines[0], lines[0]
    assert_no_crash_dump(err)


def test_too_small_shared_memory_gives_one_line_from_rank_0(shards, tmp_path):
    # More slots than /dev/shm can hold, whatever its size: 16 digits (8x8 float32) per slot.
    prefetch = max(10**6, 4 * free_bytes(shm_dir()) // (16 * 64 * 4))
    proc = subprocess.run(
        train_cmd(2, "--data", shards, *LONG_RUN, "--workers", 1, "--prefetch", prefetch),
        capture_output=True,
        text=True,
        env=mpi_env(),
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 2, proc.stderr[-4000:]
    lines = error_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr[-4000:]
    assert "MiB of shared memory in" in lines[0] and "lower --prefetch" in lines[0], lines[0]
    assert lines[0].startswith("hpcdl.train: error: ")
    assert_no_crash_dump(proc.stderr)
