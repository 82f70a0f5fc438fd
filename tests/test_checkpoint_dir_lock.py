"""One run at a time in a --checkpoint-dir: a second run started while the first holds it is
refused at start in one line (two runs would replace each other's checkpoints of the same
names, and a --resume auto continue the other's run); a run that was killed never blocks the
next. Real `python -m hpcdl.train` processes (MPI singletons) on the digits data."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys

from helpers import mpi_env, run_train, wait_until

from hpcdl import checkpoint
from hpcdl.run_outputs import LOCK_NAME

BASE = ["--model", "mlp", "--batch-size", 8, "--workers", 0, "--progress", "none"]


def start(digits_dir, ckpt, *more) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "hpcdl.train", "--data", str(digits_dir / "train"),
           *map(str, BASE), "--checkpoint-dir", str(ckpt), *map(str, more)]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=mpi_env())  # fmt: skip


def test_a_second_run_on_a_checkpoint_dir_in_use_is_refused(digits_dir, tmp_path):
    ckpt = tmp_path / "sh"
    first = start(digits_dir, ckpt, "--epochs", 50, "--seed", 1, "--checkpoint-every", 20)
    try:
        wait_until(lambda: checkpoint.latest(ckpt), 120, "the first run's first checkpoint")
        second = run_train(1, "--data", digits_dir / "train", *BASE, "--epochs", 4, "--seed", 2,
                           "--checkpoint-dir", ckpt, "--resume", "auto",
                           "--metrics", tmp_path / "mB.jsonl")  # fmt: skip
        assert first.poll() is None, "the first run ended before the second was refused"
    finally:
        first.send_signal(signal.SIGTERM)
        out, err = first.communicate(timeout=120)
    output = second.stdout + second.stderr
    assert second.returncode == 2, output
    assert [line for line in output.splitlines() if "error" in line] == [
        f"hpcdl.train: error: --checkpoint-dir {ckpt} is in use by another run (pid "
        f"{first.pid} on {socket.gethostname()}, which holds {ckpt / LOCK_NAME}); wait until it "
        "ends, or give this run another --checkpoint-dir"
    ], output
    assert not (tmp_path / "mB.jsonl").exists()
    assert first.returncode == 3, err[-3000:]  # stopped by the signal, with a checkpoint
    ids = {checkpoint.recorded(p, "run_id") for p in checkpoint.list_checkpoints(ckpt)}
    assert len(ids) == 1 and None not in ids
    assert not (ckpt / LOCK_NAME).exists()  # the first run removed its lock as it left
    resumed = run_train(1, "--data", digits_dir / "train", *BASE, "--epochs", 50, "--seed", 1,
                        "--checkpoint-dir", ckpt, "--resume", "auto", "--max-steps", 1)  # fmt: skip
    assert "nothing to train" in resumed.stdout, resumed.stdout + resumed.stderr[-3000:]


def test_a_killed_run_leaves_its_lock_file_but_never_blocks_the_next(digits_dir, tmp_path):
    ckpt = tmp_path / "ck"
    first = start(digits_dir, ckpt, "--epochs", 50, "--checkpoint-every", 20)
    wait_until(lambda: checkpoint.latest(ckpt), 120, "the first run's first checkpoint")
    first.kill()
    first.communicate(timeout=60)
    assert (ckpt / LOCK_NAME).exists()  # SIGKILL: no clean-up ran, the kernel dropped the lock
    done = checkpoint.latest(ckpt)
    step = checkpoint.load(done).global_step
    more = ["--checkpoint-dir", ckpt, "--resume", "auto", "--max-steps", step + 2]
    resumed = run_train(1, "--data", digits_dir / "train", *BASE, "--epochs", 50, *more)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr[-3000:]
    assert checkpoint.load(checkpoint.latest(ckpt)).global_step == step + 2
    assert not (ckpt / LOCK_NAME).exists()
