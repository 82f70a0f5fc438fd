"""A stage dir is kept out of the data set's directory, whatever --data names in it: a tar shard
pattern or one .tar file stands for the directory that holds the shards (hpcdl.staging.
ownership.data_root), in hpcdl.train, in a stage-only run and in the dry run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers import make_folder, own_lines, run_train, stage_cli
from tarshards_helpers import shards_of_folder

from hpcdl.staging.ownership import StageDirError, check_stage_dir, data_root

PATTERN = "shard-{000000..000003}.tar"


@pytest.fixture
def shards(tmp_path: Path) -> Path:
    """tmp_path/pfs/shards: 4 tar shards of 12 images of 3 classes."""
    make_folder(tmp_path / "imgs", per_class=16, classes=("a", "b", "c"), fmt="jpg")
    shards_of_folder(tmp_path / "imgs", tmp_path / "pfs" / "shards", 12)
    return tmp_path / "pfs" / "shards"


def files_under(root: Path) -> dict[str, bytes]:
    """Every path under root -> its bytes (b"" for a directory)."""
    out = {}
    for d, dirs, files in os.walk(root):
        out.update({os.path.join(d, n): b"" for n in dirs})
        out.update({os.path.join(d, n): Path(d, n).read_bytes() for n in files})
    return out


def test_a_pattern_or_one_tar_stands_for_the_shards_directory(shards):
    assert data_root(shards / PATTERN) == shards
    assert data_root(shards / "shard-000000.tar") == shards
    assert data_root(shards) == shards  # a directory, an HDF5 file: as given
    assert data_root(shards / "missing.h5") == shards / "missing.h5"


@pytest.mark.parametrize(
    "data,stage,how",
    [
        (PATTERN, "shards/stage", "it lies inside the data"),
        ("shard-000000.tar", "shards/stage", "it lies inside the data"),
        (PATTERN, "shards", "it is the same directory"),
        (PATTERN, ".", "it contains the data"),  # data inside the stage dir
        ("", "shards/stage", "it lies inside the data"),  # the directory itself, as before
    ],
)
def test_a_stage_dir_overlapping_the_shards_directory_is_refused(shards, data, stage, how):
    with pytest.raises(StageDirError, match=f"\\({how}\\)"):
        check_stage_dir(shards.parent / stage, {"--data": shards / data})


def test_a_stage_dir_beside_the_shards_is_allowed(shards):
    check_stage_dir(shards.parent / "stage", {"--data": shards / PATTERN})
    check_stage_dir(shards.parent / "stage", {"--data": shards / "shard-000000.tar"})


def test_stage_only_into_the_shards_directory_is_refused_and_writes_nothing(shards):
    before = files_under(shards)
    out = stage_cli("--data", shards / PATTERN, "--stage-dir", shards / "st", "--batch-size", 4)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith(f"hpcdl.stage: error: --stage-dir {shards / 'st'} overlaps")
    assert out.stderr.count("\n") == 1 and str(shards) in out.stderr
    assert files_under(shards) == before


@pytest.mark.parametrize("data", [PATTERN, "shard-000001.tar"])  # 2 classes
def test_training_with_a_stage_dir_in_the_shards_directory_is_refused(shards, data):
    before = files_under(shards)
    proc = run_train(
        1,
        *("--data", shards / data, "--model", "mlp", "--epochs", 1, "--batch-size", 4),
        *("--stage-dir", shards / "stage"),
        timeout=120,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in output, output
    errors = [line for line in own_lines(output) if "error" in line]
    assert len(errors) == 1, output
    assert errors[0].startswith(f"hpcdl.train: error: --stage-dir {shards / 'stage'} overlaps")
    assert files_under(shards) == before
