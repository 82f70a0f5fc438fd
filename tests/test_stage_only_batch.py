"""`python -m hpcdl.stage` (stage-only) refuses a --batch-size larger than a rank's share, as
the training run and the dry run do: it staged nothing and exited 0 before."""

from __future__ import annotations

from pathlib import Path

from helpers import make_folder, stage_cli
from tarshards_helpers import shards_of_folder

PATTERN = "shard-{000000..000003}.tar"


def shards(tmp_path: Path) -> Path:
    """tmp_path/shards: 4 tar shards of 12 images of 3 classes (48 samples)."""
    make_folder(tmp_path / "imgs", per_class=16, classes=("a", "b", "c"), fmt="jpg")
    shards_of_folder(tmp_path / "imgs", tmp_path / "shards", 12)
    return tmp_path / "shards"


def test_a_batch_larger_than_a_ranks_share_is_refused_and_nothing_is_staged(tmp_path):
    data, stage = shards(tmp_path) / PATTERN, tmp_path / "stage"
    done = stage_cli("--data", data, "--stage-dir", stage, "--batch-size", 100, "--nodes", 2)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr == (
        f"hpcdl.stage: error: --batch-size 100 is larger than each rank's shard of {data} "
        "(48 samples / 2 ranks = 24); use a batch size <= 24 or fewer ranks\n"
    )
    assert not stage.exists()


def test_a_batch_that_fits_is_staged(tmp_path):
    data, stage = shards(tmp_path) / PATTERN, tmp_path / "stage"
    done = stage_cli("--data", data, "--stage-dir", stage, "--batch-size", 24, "--nodes", 2)
    assert done.returncode == 0, done.stdout + done.stderr
    assert any(p.suffix == ".tar" for p in stage.rglob("*")), sorted(stage.rglob("*"))
