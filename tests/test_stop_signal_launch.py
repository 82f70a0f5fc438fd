"""SIGTERM to `python -m hpcdl.launch` while the ranks are still starting (a torch model being
built: the 6-15 s in which it used to kill them with no line and no checkpoint) stops the run
at its first step: `stopped by signal SIGUSR1, checkpoint at ...`, exit 3 (docs/slurm.md)."""

from __future__ import annotations

import signal
import sys

from helpers import own_lines, wait_until
from stop_signal_model import held_ranks, model_dir, release, start, train_argv

from hpcdl import checkpoint


def test_sigterm_to_launch_during_start_up_stops_the_run_at_its_first_step(digits_dir, tmp_path):
    where, ck = model_dir(tmp_path, "start"), tmp_path / "ck"
    argv = train_argv(where, digits_dir / "train", ck, "--epochs", "6")
    job = start([sys.executable, "-m", "hpcdl.launch", *argv], tmp_path)
    held_ranks(job, where, "start")
    job.send_signal(signal.SIGTERM)
    # the launcher passes it on as SIGUSR1 (its line comes first), mpirun to every rank
    said = "hpcdl.launch: got SIGTERM, asking all ranks to checkpoint and stop (SIGUSR1)"
    seen: list[str] = []
    wait_until(lambda: seen.append(job.stderr.readline()) or said in seen[-1], 120, said)
    out, err = release(job, where, "start")
    err = "".join(seen) + err
    assert job.returncode == 3, err[-4000:]
    saved = checkpoint.latest(ck)
    assert f"hpcdl.train: stopped by signal SIGUSR1, checkpoint at {saved}" in own_lines(out)
    assert checkpoint.load(saved).global_step == 1
    for text in ("Traceback", "died", "error", "exited on signal"):
        assert text not in out + err, (out + err)[-4000:]
