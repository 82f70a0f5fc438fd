"""A stop signal at any moment of a run ends it as a stop, never as a silent kill
(docs/reliability.md, "What each failure prints"): during start-up (here: while the engine is
built) it stops the run at its first step, with a checkpoint and `stopped by signal`, exit 3;
after the last step it changes nothing, exit 0. Real `mpirun -np 2` jobs of a user's torch
model; each rank is held at the moment by the model file (tests/stop_signal_model.py)."""

from __future__ import annotations

import signal

import numpy as np
import pytest
from helpers import own_lines
from stop_signal_model import (
    held_ranks,
    model_dir,
    release,
    signal_all,
    start,
    train_argv,
)

from hpcdl import checkpoint

EPOCHS = ("--epochs", "2", "--val-data")


def assert_no_failure_said(out: str, err: str) -> None:
    for text in ("Traceback", "died", "error", "exited on signal"):
        assert text not in out + err, (out + err)[-4000:]


@pytest.mark.parametrize(
    ("sig", "ranks"),
    [(signal.SIGTERM, slice(None)), (signal.SIGUSR1, slice(1, 2)), (signal.SIGINT, slice(0, 1))],
    ids=["SIGTERM-both-ranks", "SIGUSR1-rank-1", "SIGINT-rank-0"],
)
def test_a_signal_during_start_up_stops_at_the_first_step_with_a_checkpoint(
    sig, ranks, digits_dir, tmp_path
):
    where, ck = model_dir(tmp_path, "start"), tmp_path / "ck"
    argv = train_argv(where, digits_dir / "train", ck, *EPOCHS, str(digits_dir / "val"))
    job = start(argv, tmp_path)
    pids = held_ranks(job, where, "start")
    signal_all(sorted(pids)[ranks], sig)  # ranks in pid order: which one does not matter
    out, err = release(job, where, "start")
    assert job.returncode == 3, err[-4000:]
    saved = checkpoint.latest(ck)
    assert f"hpcdl.train: stopped by signal {sig.name}, checkpoint at {saved}" in own_lines(out)
    assert checkpoint.load(saved).global_step == 1  # the first step's boundary
    assert_no_failure_said(out, err)


def test_a_signal_after_the_last_step_changes_nothing(digits_dir, tmp_path):
    where, ck = model_dir(tmp_path, "exit"), tmp_path / "ck"
    job = start(train_argv(where, digits_dir / "train", ck, "--max-steps", "3"), tmp_path)
    pids = held_ranks(job, where, "exit")  # in atexit: after the run's last line
    signal_all(pids, signal.SIGUSR1)
    signal_all(pids, signal.SIGTERM)
    out, err = release(job, where, "exit")
    assert job.returncode == 0, err[-4000:]
    assert [line for line in own_lines(out) if line.startswith("hpcdl.train: final train loss")]
    assert "stopped by signal" not in out + err
    assert_no_failure_said(out, err)


def test_a_run_stopped_during_start_up_and_resumed_equals_an_uninterrupted_run(
    digits_dir, tmp_path
):
    data = digits_dir / "train"
    plain = tmp_path / "plain"
    plain.mkdir()
    whole = start(train_argv(model_dir(plain), data, plain / "ck", "--max-steps", "12"), plain)
    out, err = whole.communicate(timeout=300)
    assert whole.returncode == 0, err[-4000:]

    where, ck = model_dir(tmp_path, "start"), tmp_path / "ck"
    job = start(train_argv(where, data, ck, "--max-steps", "12"), tmp_path)
    signal_all(held_ranks(job, where, "start"), signal.SIGUSR1)
    out, err = release(job, where, "start")
    assert job.returncode == 3, err[-4000:]
    assert checkpoint.load(checkpoint.latest(ck)).global_step == 1
    (where / "hold-start").unlink()
    again = start(train_argv(where, data, ck, "--max-steps", "12", "--resume", "auto"), tmp_path)
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err[-4000:]
    want = checkpoint.load(checkpoint.latest(plain / "ck"))
    got = checkpoint.load(checkpoint.latest(ck))
    assert got.global_step == want.global_step == 12
    np.testing.assert_array_equal(got.params, want.params)
    assert got.optimizer.keys() == want.optimizer.keys()
    for key, value in want.optimizer.items():
        np.testing.assert_array_equal(got.optimizer[key], value)
    # BatchNorm's running statistics are rank 0's in a checkpoint (docs/torch.md), so a
    # mid-epoch resume is bitwise in the parameters and the optimizer state, not in those
