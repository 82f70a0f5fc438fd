"""A run that --max-steps stops writes a checkpoint at that step (with --checkpoint-dir), so a
resume at it has nothing to train (one line, exit 0), and a resume with a larger --max-steps
goes on from it and ends bitwise as one run to that step. Real 2-rank runs on digits."""

from __future__ import annotations

from pathlib import Path

from helpers import run_train

from hpcdl import checkpoint

BASE = ["--model", "mlp", "--batch-size", 32, "--workers", 0, "--seed", 3,
        "--progress", "none", "--epochs", 3]  # fmt: skip


def newest(ckpt_dir: Path) -> checkpoint.Checkpoint:
    return checkpoint.load(checkpoint.latest(ckpt_dir))


def test_max_steps_writes_its_checkpoint_and_a_resume_there_has_nothing_to_train(
    digits_dir, tmp_path
):
    data, ckpt = ["--data", digits_dir / "train"], tmp_path / "ck"
    first = run_train(2, *data, *BASE, "--max-steps", 10, "--checkpoint-dir", ckpt)
    assert first.returncode == 0, first.stderr[-3000:]
    assert [p.name for p in checkpoint.list_checkpoints(ckpt)] == [
        checkpoint.checkpoint_name(0, 10)
    ]
    saved = newest(ckpt)
    assert (saved.epoch, saved.step_in_epoch, saved.global_step) == (0, 10, 10)
    again = run_train(2, *data, *BASE, "--max-steps", 10, "--checkpoint-dir", ckpt,
                      "--resume", "auto")  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert (
        f"hpcdl.train: nothing to train: checkpoint {ckpt / checkpoint.checkpoint_name(0, 10)} "
        "has reached --max-steps 10"
    ) in again.stdout.splitlines(), again.stdout


def test_a_resume_from_a_max_steps_checkpoint_ends_bitwise_as_one_run(digits_dir, tmp_path):
    data, whole, cut = ["--data", digits_dir / "train"], tmp_path / "whole", tmp_path / "cut"
    one = run_train(2, *data, *BASE, "--max-steps", 30, "--checkpoint-dir", whole)
    assert one.returncode == 0, one.stderr[-3000:]
    first = run_train(2, *data, *BASE, "--max-steps", 27, "--checkpoint-dir", cut)
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_train(2, *data, *BASE, "--max-steps", 30, "--checkpoint-dir", cut,
                       "--resume", "auto")  # fmt: skip
    assert second.returncode == 0, second.stderr[-3000:]
    assert "hpcdl: resumed at epoch 2, step 5 (auto)" in second.stdout.splitlines()
    a, b = newest(whole), newest(cut)
    assert a.global_step == b.global_step == 30
    assert a.params.tobytes() == b.params.tobytes()
    assert sorted(a.optimizer) == sorted(b.optimizer)
    for key in a.optimizer:
        assert a.optimizer[key].tobytes() == b.optimizer[key].tobytes()
