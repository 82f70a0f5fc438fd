"""An epoch resumed mid-way reports the whole epoch's training loss and accuracy.

A checkpoint taken inside an epoch (--checkpoint-every, a stop signal) holds every rank's sums
of that epoch so far (loss, steps, correct, samples); the resumed run starts its epoch's sums
from them, so its `epoch` record, progress line and final line are the uninterrupted run's,
not the mean of the steps since the resume (an independent check: `final train loss 1.1100`
after a resume against 1.1234 uninterrupted).
"""

from __future__ import annotations

import pytest
from helpers import read_events, run_train

from hpcdl import checkpoint

BASE = ["--model", "mlp", "--batch-size", 32, "--workers", 0, "--seed", 5, "--epochs", 2, "--quiet"]


def test_a_mid_epoch_resume_reports_the_uninterrupted_epochs_loss_and_accuracy(
    digits_dir, tmp_path
):
    data = ["--data", digits_dir / "train"]
    whole = run_train(2, *data, *BASE, "--metrics", tmp_path / "whole.jsonl", timeout=180)
    assert whole.returncode == 0, whole.stderr[-3000:]

    ckpt = tmp_path / "ckpt"
    first = run_train(2, *data, *BASE, "--checkpoint-dir", ckpt, "--checkpoint-every", 5,
                      "--max-steps", 25, timeout=180)  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    saved = checkpoint.load(checkpoint.latest(ckpt))
    assert (saved.epoch, saved.step_in_epoch, saved.global_step) == (1, 3, 25)  # mid-epoch 2
    assert saved.epoch_sums is not None and len(saved.epoch_sums) == 2  # one row per rank
    assert [row[0] for row in saved.epoch_sums] == [3, 3]  # steps of epoch 2 so far, per rank

    resumed = run_train(2, *data, *BASE, "--checkpoint-dir", ckpt, "--resume", "auto",
                        "--metrics", tmp_path / "resumed.jsonl", timeout=180)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    want = read_events(tmp_path / "whole.jsonl", "epoch")[-1]
    got = read_events(tmp_path / "resumed.jsonl", "epoch")[-1]
    assert got["epoch"] == want["epoch"] == 1
    assert (got["loss"], got["acc"]) == (want["loss"], want["acc"])  # bitwise: same sums, order
    # its rate counts what this job trained: 19 of the epoch's 22 steps, 2 ranks x 32
    assert got["images_per_s"] * got["seconds"] == pytest.approx(19 * 2 * 32)
    assert (
        resumed.stdout.strip().splitlines()[-1].split("(")[0]
        == (whole.stdout.strip().splitlines()[-1].split("(")[0])
    )  # "final train loss L, train acc A", the rate aside
