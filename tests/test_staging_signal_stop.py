"""A signal stop of a run that stages: the stager ends on the same signal and says so in its
own last line; hpcdl prints no RuntimeWarning about it (docs/reliability.md)."""

from __future__ import annotations

import signal
import subprocess

from helpers import mpi_env, train_cmd, wait_until


def test_a_signal_stop_with_staging_prints_no_stager_warning(digits_dir, tmp_path):
    ck, stage = tmp_path / "ck", tmp_path / "stage"
    argv = train_cmd(2, "--data", digits_dir / "train", "--model", "mlp", "--epochs", "300",
                     "--batch-size", "16", "--workers", "0", "--progress", "none",
                     "--checkpoint-dir", ck, "--checkpoint-every", "5",
                     "--stage-dir", stage)  # fmt: skip
    job = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=mpi_env(), cwd=tmp_path)  # fmt: skip
    try:
        wait_until(lambda: list(ck.glob("ckpt-*.h5")), 120, "a first checkpoint")
        job.send_signal(signal.SIGUSR1)  # mpirun passes it to the ranks and their stager
        out, err = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode == 3, err[-3000:]
    assert "hpcdl.train: stopped by signal SIGUSR1" in out + err
    assert "RuntimeWarning" not in err and "staging process stopped" not in err, err[-3000:]
