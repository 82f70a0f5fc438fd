"""A run's outputs never land inside its data: a --checkpoint-dir, --metrics or --timeline that
is or lies inside --data or --val-data (symlinks resolved) is refused at start in one line,
before anything is written, since its files would be read as samples by the next run (a
checkpoint is an .h5 file beside the shards). A checkpoint dir that contains the data, or sits
beside it, is fine. Real runs of `python -m hpcdl.train` on a copy of the digits data."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers import run_train

from hpcdl.config import TrainConfig
from hpcdl.run_outputs import inside_data_error

BASE = ["--model", "mlp", "--batch-size", 32, "--workers", 0, "--seed", 3, "--quiet"]


@pytest.fixture
def data(digits_dir, tmp_path) -> Path:
    """A copy of the digits data (train/, val/) that a failing run may spoil."""
    return Path(shutil.copytree(digits_dir, tmp_path / "d2"))


def listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def assert_refused(proc, line: str) -> None:
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    assert "Traceback" not in output and "Epoch" not in output, output
    errors = [x for x in output.splitlines() if "error" in x]
    assert errors == [f"hpcdl.train: error: {line}"], output


def test_a_checkpoint_dir_that_is_the_data_is_refused_and_the_data_kept(data):
    before = listing(data)
    train = data / "train"
    proc = run_train(1, "--data", train, *BASE, "--epochs", 1, "--checkpoint-dir", train)
    assert_refused(
        proc,
        f"--checkpoint-dir {train} is --data {train}: its files would be read as part of the "
        "data set; choose a path outside the data",
    )
    assert listing(data) == before
    again = run_train(1, "--data", train, *BASE, "--max-steps", 1)
    assert again.returncode == 0, again.stderr[-3000:]


def test_a_checkpoint_dir_inside_the_val_data_through_a_symlink_is_refused(data, tmp_path):
    before = listing(data)
    (tmp_path / "link").symlink_to(data / "val")
    inside = tmp_path / "link" / "ck"
    proc = run_train(1, "--data", data / "train", "--val-data", data / "val", *BASE,
                     "--epochs", 1, "--checkpoint-dir", inside)  # fmt: skip
    assert_refused(
        proc,
        f"--checkpoint-dir {inside} lies inside --val-data {data / 'val'}: its files would be "
        "read as part of the data set; choose a path outside the data",
    )
    assert listing(data) == before


@pytest.mark.parametrize("flag", ["--metrics", "--timeline"])
def test_a_metrics_or_timeline_file_inside_the_data_is_refused(data, flag):
    before = listing(data)
    inside = data / "train" / "out.json"
    proc = run_train(1, "--data", data / "train", *BASE, "--max-steps", 1, flag, inside)
    assert_refused(
        proc,
        f"{flag} {inside} lies inside --data {data / 'train'}: its files would be read as part "
        "of the data set; choose a path outside the data",
    )
    assert listing(data) == before


def test_a_checkpoint_dir_that_contains_the_data_is_accepted(data):
    proc = run_train(1, "--data", data / "train", *BASE, "--max-steps", 2, "--checkpoint-dir",
                     data, "--metrics", data / "m.jsonl")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in data.glob("ckpt-*.h5")) == ["ckpt-e00000-s000000002.h5"]


def test_a_checkpoint_dir_beside_tar_shards_is_inside_their_directory(tmp_path):
    pattern = tmp_path / "shards-{000..001}.tar"
    cfg = TrainConfig(data=str(pattern), checkpoint_dir=str(tmp_path))
    assert inside_data_error(cfg) == (
        f"--checkpoint-dir {tmp_path} is {tmp_path}, the directory of --data {pattern}: its "
        "files would be read as part of the data set; choose a path outside the data"
    )
    beside = TrainConfig(data=str(pattern), checkpoint_dir=str(tmp_path.parent / "ck"))
    assert inside_data_error(beside) is None
