"""Resuming a run that has nothing left to train: one line, exit status 0, whatever the flags.

A job chain (docs/slurm.md) resubmits the same command until the run is done, so its last job
always resumes a finished run; it must say so and succeed, not crash in start-up (issue 26: with
--stage-dir the stager planned an empty epoch range and every rank aborted).
"""

from __future__ import annotations

import shutil

import pytest
from helpers import run_train

from hpcdl import checkpoint

BASE = ["--model", "mlp", "--batch-size", 32, "--workers", 0, "--seed", 3]


@pytest.fixture(scope="module")
def finished(digits_dir, tmp_path_factory):
    """Checkpoint directories of two finished runs: 1 epoch, and --max-steps 5 mid-epoch."""
    out = tmp_path_factory.mktemp("finished")
    runs = {"epochs": ["--epochs", 1], "max-steps": ["--epochs", 2, "--max-steps", 5]}
    for name, args in runs.items():
        proc = run_train(2, "--data", digits_dir / "train", *BASE, *args, "--quiet",
                         "--checkpoint-every", 5, "--checkpoint-dir", out / name)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
    return out


# name -> (which finished run, extra flags of the resume); {stage}, {metrics}: paths under tmp
CASES = {
    "plain": ("epochs", []),
    "staging": ("epochs", ["--stage-dir", "{stage}"]),
    "staging-validation-metrics": (
        "epochs",
        ["--stage-dir", "{stage}", "--val-data", "{val}", "--metrics", "{metrics}"],
    ),
    "fp16-sync-bn-progress": ("epochs", ["--precision", "fp16", "--sync-bn", "--progress", "bar"]),
    "max-steps": ("max-steps", ["--epochs", 2, "--max-steps", 5]),
    "max-steps-staging": ("max-steps", ["--epochs", 2, "--max-steps", 5, "--stage-dir", "{stage}"]),
    "verbose-staging": ("epochs", ["--stage-dir", "{stage}", "--progress", "epoch"]),
    # mid-epoch with another order and lr: nothing is read, so nothing to refuse or to say
    "verbose-max-steps-seed-lr": (
        "max-steps",
        ["--epochs", 2, "--max-steps", 5, "--seed", 4, "--lr", 0.5],
    ),  # fmt: skip
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_resuming_a_finished_run_says_one_line_and_exits_0(case, finished, digits_dir, tmp_path):
    which, flags = CASES[case]
    quiet = not case.startswith("verbose")
    ckpt_dir = tmp_path / "ckpt"
    shutil.copytree(finished / which, ckpt_dir)
    before = {p.name: p.read_bytes() for p in ckpt_dir.iterdir()}
    paths = {"stage": tmp_path / "stage", "metrics": tmp_path / "m.jsonl"}
    paths["val"] = digits_dir / "val"
    flags = [str(f).format(**paths) for f in flags]
    epochs = [] if "--epochs" in flags else ["--epochs", 1]
    proc = run_train(2, "--data", digits_dir / "train", *BASE, *epochs, *flags,
                     *(["--quiet"] if quiet else []), "--checkpoint-dir", ckpt_dir,
                     "--resume", "auto", timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    lines = (proc.stdout + proc.stderr).splitlines()
    saved = checkpoint.latest(ckpt_dir)
    assert [line for line in lines if line.startswith("hpcdl.train")] == [
        f"hpcdl.train: nothing to train: checkpoint {saved} "
        + ("has reached --max-steps 5" if which == "max-steps" else "is at the end of --epochs 1")
    ], proc.stdout + proc.stderr[-3000:]
    assert proc.stderr == "", proc.stderr[-3000:]
    assert not [line for line in lines if "this run changes" in line], proc.stdout
    # --quiet: that line only; else after the start-up lines that say where the run stands
    assert len(lines) == 1 if quiet else lines[-1].startswith("hpcdl.train"), proc.stdout
    assert {p.name: p.read_bytes() for p in ckpt_dir.iterdir()} == before  # nothing trained
    assert not any(paths["stage"].rglob("*")), list(paths["stage"].rglob("*"))  # nothing staged
