"""`python -m hpcdl.stage --dry-run` refuses what the real run refuses (a batch larger than a
rank's share, a stage dir that is a file or lies in the data), creating nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import make_folder, make_tree, own_lines, run_train, stage_cli
from tarshards_helpers import shards_of_folder

PATTERN = "shard-{000000..000003}.tar"


@pytest.fixture
def shards(tmp_path: Path) -> Path:
    """tmp_path/shards: 4 tar shards of 12 images of 3 classes (48 samples)."""
    make_folder(tmp_path / "imgs", per_class=16, classes=("a", "b", "c"), fmt="jpg")
    shards_of_folder(tmp_path / "imgs", tmp_path / "shards", 12)
    return tmp_path / "shards"


def dry_run(shards: Path, *args) -> object:
    return stage_cli("--dry-run", "--data", shards / PATTERN, "--nodes", 2, *args)


def test_a_batch_larger_than_a_ranks_share_is_refused_as_training_refuses_it(shards):
    dry = dry_run(shards, "--batch-size", 100)
    assert (dry.returncode, dry.stdout) == (2, ""), dry.stdout + dry.stderr
    train = run_train(2, "--data", shards / PATTERN, "--batch-size", 100, "--model", "mlp")
    errors = [line for line in own_lines(train.stdout + train.stderr) if "error" in line]
    assert train.returncode == 2 and len(errors) == 1, train.stdout + train.stderr
    said = errors[0].removeprefix("hpcdl.train: error: ")
    assert said.startswith("--batch-size 100 is larger than each rank's shard of ")
    assert "(48 samples / 2 ranks = 24)" in said
    assert dry.stderr == f"hpcdl.stage: error: {said}\n"


def test_a_batch_that_fits_a_ranks_share_is_planned(shards):
    dry = dry_run(shards, "--batch-size", 24, "--json")
    assert dry.returncode == 0, dry.stderr
    assert sum(n["files"] for n in json.loads(dry.stdout.splitlines()[-1])["nodes"]) >= 4


@pytest.mark.parametrize("where", ["file", "in the shards", "in the data tree"])
def test_a_stage_dir_the_real_run_refuses_is_refused_and_nothing_is_created(tmp_path, where):
    if where == "in the data tree":
        data = make_tree(tmp_path / "data", 8, 100).root
        args, stage = ("--data", data, "--files-only"), data / "x"
    else:
        make_folder(tmp_path / "imgs", per_class=4, classes=("a", "b"), fmt="jpg")
        shards = tmp_path / "shards"
        shards_of_folder(tmp_path / "imgs", shards, 4)
        args = ("--data", shards / "shard-{000000..000001}.tar")
        stage = tmp_path / "afile" if where == "file" else shards / "x"
    if where == "file":
        stage.write_text("mine")
    before = sorted(p for p in tmp_path.rglob("*"))
    dry = stage_cli("--dry-run", *args, "--batch-size", 2, "--stage-dir", stage)
    assert (dry.returncode, dry.stdout) == (2, ""), dry.stdout + dry.stderr
    assert dry.stderr.count("\n") == 1, dry.stderr
    why = "cannot use --stage-dir" if where == "file" else f"--stage-dir {stage} overlaps"
    assert dry.stderr.startswith(f"hpcdl.stage: error: {why}"), dry.stderr
    assert sorted(p for p in tmp_path.rglob("*")) == before
    if where == "file":
        assert stage.read_text() == "mine"


def test_a_usable_stage_dir_is_planned_for_and_not_created(shards, tmp_path):
    dry = dry_run(shards, "--batch-size", 4, "--stage-dir", tmp_path / "stage")
    assert dry.returncode == 0, dry.stderr
    assert not (tmp_path / "stage").exists()
