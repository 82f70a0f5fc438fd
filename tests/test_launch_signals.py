"""`python -m hpcdl.launch` under a user's or a batch system's signal, its --help, and what it
leaves behind when the run refuses its flags (docs/reliability.md, docs/slurm.md)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import job_pids, mpi_env, mpirun_cmd, wait_until


def launch_train(tmp_path: Path, digits: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "hpcdl.launch", *mpirun_cmd(2), sys.executable, "-m",
            "hpcdl.train", "--data", str(digits / "train"), "--model", "mlp", "--batch-size",
            "16", "--workers", "0", "--progress", "none", "--seed", "0", *args]  # fmt: skip


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_launch_stops_the_run_with_a_checkpoint_and_exit_3(sig, digits_dir, tmp_path):
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    argv = launch_train(tmp_path, digits_dir, "--epochs", "300", "--checkpoint-dir", str(ck),
                        "--checkpoint-every", "5", "--metrics", str(metrics))  # fmt: skip
    job = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=mpi_env(), cwd=tmp_path)  # fmt: skip
    try:
        wait_until(lambda: list(ck.glob("ckpt-*.h5")), 120, "a first checkpoint")
        job.send_signal(sig)
        out, err = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode == 3, err[-3000:]
    assert f"hpcdl.train: stopped by signal SIGUSR1, checkpoint at {ck}" in err + out, err
    assert not [p.name for p in ck.iterdir() if p.name.endswith(".tmp")]
    assert "Traceback" not in err


def test_sigterm_to_every_process_as_scancel_sends_it_still_stops_with_a_checkpoint(
    digits_dir, tmp_path
):
    """Slurm's scancel signals the launcher, mpirun and every rank at once; mpirun, which would
    kill the ranks mid-checkpoint, runs with SIGTERM blocked (NOTE [mpirun and SIGTERM])."""
    ck, marker = tmp_path / "ck", f"scancel-{os.getpid()}"
    argv = launch_train(tmp_path, digits_dir, "--epochs", "300", "--checkpoint-dir", str(ck),
                        "--checkpoint-every", "5")  # fmt: skip
    env = {**mpi_env(), "HPCDL_TEST_MARKER": marker}
    job = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=env, cwd=tmp_path)  # fmt: skip
    try:
        wait_until(lambda: list(ck.glob("ckpt-*.h5")), 120, "a first checkpoint")
        pids = job_pids(marker)
        assert job.pid in pids and len(pids) >= 4, pids  # launch, mpirun, 2 ranks
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        out, err = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode == 3, err[-3000:]
    assert f"hpcdl.train: stopped by signal SIGTERM, checkpoint at {ck}" in err + out, err
    assert not [p.name for p in ck.iterdir() if p.name.endswith(".tmp")]


def test_a_second_sigterm_to_launch_passes_as_it_is(tmp_path):
    """A launcher that is not Open MPI's (a stand-in here) gets SIGUSR1 first, then SIGTERM."""
    seen = tmp_path / "seen"
    script = (f"trap 'echo USR1 >> {seen}' USR1; trap 'echo TERM >> {seen}; exit 7' TERM; "
              f"echo up >> {seen}; while :; do sleep 0.05; done")  # fmt: skip
    job = subprocess.Popen([sys.executable, "-m", "hpcdl.launch", "sh", "-c", script],
                           stderr=subprocess.PIPE, text=True, cwd=tmp_path)  # fmt: skip
    try:
        wait_until(lambda: seen.exists() and "up" in seen.read_text(), 60, "the stand-in")
        job.send_signal(signal.SIGTERM)
        wait_until(lambda: "USR1" in seen.read_text(), 60, "SIGUSR1 passed on")
        job.send_signal(signal.SIGTERM)
        _, err = job.communicate(timeout=60)
    finally:
        job.kill()
    assert job.returncode == 7, err
    assert seen.read_text().split() == ["up", "USR1", "TERM"]
    assert "hpcdl.launch: got SIGTERM, asking all ranks to checkpoint and stop (SIGUSR1)" in err


def test_sigterm_blocked_runs_a_command_with_sigterm_blocked(tmp_path):
    show = "import signal; print(signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, []))"
    done = subprocess.run([sys.executable, "-m", "hpcdl.sigterm_blocked", sys.executable, "-c",
                           show], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0 and done.stdout == "True\n", done.stderr
    missing = subprocess.run([sys.executable, "-m", "hpcdl.sigterm_blocked", str(tmp_path / "no")],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    assert missing.returncode == 127
    assert missing.stderr.startswith("hpcdl.sigterm_blocked: error: cannot start"), missing.stderr


def test_launch_help_prints_a_usage_and_exits_0(tmp_path):
    done = subprocess.run([sys.executable, "-m", "hpcdl.launch", "--help"], capture_output=True,
                          text=True, timeout=60, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m hpcdl.launch LAUNCHER"), done.stdout
    assert "cannot start" not in done.stderr


@pytest.mark.parametrize(
    ("flags", "left"),
    [
        (["--checkpoint-dir", "newck/sub"], "newck"),
        (["--metrics", "mdir/x/m.jsonl"], "mdir"),
    ],
)
def test_a_refused_run_under_launch_creates_no_directory(flags, left, digits_dir, tmp_path):
    argv = launch_train(tmp_path, digits_dir, "--epochs", "0", *flags)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=mpi_env(),
                          cwd=tmp_path)  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    assert "--epochs" in done.stderr
    assert not (tmp_path / left).exists()
    assert list(tmp_path.iterdir()) == []
