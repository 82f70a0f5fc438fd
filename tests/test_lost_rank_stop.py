"""--on-node-loss stop under `mpirun --with-ft ulfm`: a rank killed outright ends the job with
one line naming it from a survivor, never a traceback (docs/reliability.md)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from helpers import mpi_env, mpirun_cmd, own_lines, rank_pid, wait_until


def test_a_survivor_names_the_lost_rank_in_one_line(digits_dir, tmp_path):
    ck, marker = tmp_path / "c", f"lost-stop-{os.getpid()}"
    argv = [sys.executable, "-m", "hpcdl.launch", *mpirun_cmd(2), "--with-ft", "ulfm",
            sys.executable, "-m", "hpcdl.train", "--data", str(digits_dir / "train"), "--model",
            "mlp", "--epochs", "300", "--batch-size", "16", "--workers", "0", "--progress",
            "none", "--on-node-loss", "stop", "--checkpoint-dir", str(ck),
            "--checkpoint-every", "5"]  # fmt: skip
    env = {**mpi_env(), "HPCDL_TEST_MARKER": marker}
    job = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=env, cwd=tmp_path)  # fmt: skip
    try:
        wait_until(lambda: list(ck.glob("ckpt-*.h5")), 120, "a first checkpoint")
        os.kill(rank_pid(marker, 1), signal.SIGKILL)
        out, err = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode == 5, err[-3000:]
    assert "Traceback" not in err and "failed:" not in err, err[-3000:]
    lost = [line for line in own_lines(err) if "lost rank 1" in line]
    assert len(lost) == 1 and lost[0].startswith("hpcdl: rank 0: error: lost rank 1"), err[-3000:]
