"""A resume with other flags than its checkpoint's run: a change that would break the
exactly-once promise of the epoch in progress (another data set, --seed or --shuffle, mid-epoch)
is refused in one line naming the flag, the checkpoint's value and what to do; at an epoch's
end it is allowed and said, as is a changed --lr, --momentum or --weight-decay (a user may lower
the lr on purpose). Real runs of `python -m hpcdl.train` on the digits data (train: 1438
samples, 44 steps an epoch of 32; val: 359)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers import run_train

from hpcdl import checkpoint

BASE = ["--model", "mlp", "--batch-size", 32, "--workers", 0, "--seed", 1, "--epochs", 3,
        "--progress", "none"]  # fmt: skip


@pytest.fixture(scope="module")
def saved(digits_dir, tmp_path_factory) -> dict[str, Path]:
    """Checkpoint dirs of a run stopped mid-epoch 1 (step 30) and one at epoch 1's end."""
    out = tmp_path_factory.mktemp("saved")
    for name, stop in (("mid", 30), ("end", 44)):
        proc = run_train(1, "--data", digits_dir / "train", *BASE, "--max-steps", stop,
                         "--checkpoint-every", 10, "--checkpoint-dir", out / name)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
    return {"mid": out / "mid", "end": out / "end"}


def resume(saved, which: str, tmp_path: Path, data: Path, *more):
    ckpt = Path(shutil.copytree(saved[which], tmp_path / which))
    before = sorted(p.name for p in ckpt.iterdir())
    proc = run_train(1, "--data", data, *BASE, "--checkpoint-dir", ckpt, "--resume", "auto",
                     "--max-steps", 50, *more)  # fmt: skip
    return proc, ckpt, before


def refused(proc) -> str:
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    assert "Traceback" not in output, output
    (line,) = [x for x in output.splitlines() if "error" in x]
    return line


@pytest.mark.parametrize(
    ("more", "flag", "was", "now"),
    [(["--seed", 2], "--seed", "1", "2"), (["--shuffle", "none"], "--shuffle", "global", "none")],
)
def test_another_order_mid_epoch_is_refused(saved, digits_dir, tmp_path, more, flag, was, now):
    proc, ckpt, before = resume(saved, "mid", tmp_path, digits_dir / "train", *more)
    path = ckpt / checkpoint.checkpoint_name(0, 30)
    assert refused(proc) == (
        f"hpcdl.train: error: checkpoint {path} stopped mid-way through epoch 1, read in the "
        f"order of {flag} {was}; {flag} {now} would read the rest of it in another order (some "
        f"samples twice, some never): resume with {flag} {was}, or start afresh with another "
        "--checkpoint-dir"
    )
    assert sorted(p.name for p in ckpt.iterdir()) == before


def test_another_data_set_mid_epoch_is_refused(saved, digits_dir, tmp_path):
    proc, ckpt, before = resume(saved, "mid", tmp_path, digits_dir / "val")
    path = ckpt / checkpoint.checkpoint_name(0, 30)
    assert refused(proc) == (
        f"hpcdl.train: error: checkpoint {path} stopped mid-way through epoch 1 of --data "
        f"{digits_dir / 'train'} (1438 samples); this --data {digits_dir / 'val'} holds 359 "
        "samples: resume with the checkpoint's --data, or start afresh with another "
        "--checkpoint-dir"
    )
    assert sorted(p.name for p in ckpt.iterdir()) == before


def test_another_lr_and_momentum_are_said_and_used(saved, digits_dir, tmp_path):
    proc, ckpt, _ = resume(saved, "mid", tmp_path, digits_dir / "train", "--lr", 0.001,
                           "--momentum", 0.5)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert (
        "hpcdl: this run changes the checkpoint's --lr 0.01 to 0.001, --momentum 0.9 to 0.5"
    ) in proc.stdout.splitlines(), proc.stdout
    final = checkpoint.load(checkpoint.latest(ckpt))
    assert (final.global_step, final.config["lr"], final.config["momentum"]) == (50, 0.001, 0.5)


def test_another_seed_and_data_at_an_epochs_end_are_said(saved, digits_dir, tmp_path):
    proc, ckpt, _ = resume(saved, "end", tmp_path, digits_dir / "val", "--seed", 2)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert (
        f"hpcdl: this run changes the checkpoint's --data {digits_dir / 'train'} (1438 samples) "
        f"to {digits_dir / 'val'} (359 samples), --seed 1 to 2"
    ) in proc.stdout.splitlines(), proc.stdout
    assert checkpoint.load(checkpoint.latest(ckpt)).global_step == 50
