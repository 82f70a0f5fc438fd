"""classes.json that does not name every label, or names one class: the index knows every label,
so hpcdl.train stops at start-up in one line naming classes.json; inspect counts each class's
readable samples and says which labels classes.json lacks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import make_folder, mpi_env, own_lines, run_train
from tarshards_helpers import make_shards, shards_of_folder

from hpcdl.data import DataError, open_dataset

TRAIN = ["--model", "mlp", "--epochs", 1, "--batch-size", 4, "--quiet"]


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def shards(tmp_path: Path, classes: tuple[str, ...], named: list[str] | None) -> Path:
    """tar/: 4 images per class in 3 shards, .cls labels, classes.json naming `named`."""
    make_folder(tmp_path / "folder", per_class=4, classes=classes, fmt="jpg")
    shards_of_folder(tmp_path / "folder", tmp_path / "tar", per_shard=4)
    if named is not None:
        (tmp_path / "tar" / "classes.json").write_text(json.dumps(named))
    return tmp_path / "tar"


def inspect(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hpcdl.data", "inspect", str(path)],
        capture_output=True, text=True, env=mpi_env(), timeout=120,
    )  # fmt: skip


def test_a_short_classes_json_is_named_with_the_largest_label(tmp_path):
    data = shards(tmp_path, ("cat", "dog", "fox"), ["cat", "dog"])
    ds = open_dataset(data)
    with pytest.raises(DataError) as err:
        ds.check_classes()
    line = str(err.value)
    assert "\n" not in line and str(data / "classes.json") in line
    assert "4 samples" in line and "up to 2" in line and "member 000008.jpg" in line


def test_names_that_classes_json_lacks_are_named(tmp_path):
    make_folder(tmp_path / "folder", per_class=2, classes=("cat", "dog", "fox"), fmt="jpg")
    shards_of_folder(tmp_path / "folder", tmp_path / "tar", per_shard=3, label="txt")
    (tmp_path / "tar" / "classes.json").write_text(json.dumps(["cat", "dog"]))
    with pytest.raises(DataError, match=r"2 samples.*'fox'"):
        open_dataset(tmp_path / "tar").check_classes()


def test_hpcdl_train_stops_at_start_naming_classes_json_and_the_largest_label(tmp_path):
    data = shards(tmp_path, ("cat", "dog", "fox"), ["cat", "dog"])
    proc = run_train(1, "--data", data, *TRAIN, timeout=300)
    lines = own_lines(proc.stderr)
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "classes.json" in lines[0] and "up to 2" in lines[0]
    assert "final train loss" not in proc.stdout


def test_inspect_counts_readable_labels_and_says_which_classes_json_lacks(tmp_path):
    data = shards(tmp_path, ("cat", "dog", "fox"), ["cat", "dog"])
    proc = inspect(data)
    assert proc.returncode == 0, proc.stderr
    assert "classes:      2 (cat: 4, dog: 4)" in proc.stdout
    assert "4 samples" in proc.stdout and "classes.json" in proc.stdout and "up to 2" in proc.stdout


def test_a_one_class_classes_json_is_said_as_one_class(tmp_path):
    data = shards(tmp_path, ("cat",), ["cat"])
    proc = run_train(1, "--data", data, *TRAIN, timeout=300)
    lines = own_lines(proc.stderr)
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "one class" in lines[0] and "classes.json" in lines[0]
    assert "num_classes" not in lines[0]


def test_one_class_from_integer_labels_is_said_as_one_class(tmp_path):
    make_shards(tmp_path / "d", shards=2, per_shard=4, classes=1)
    proc = run_train(1, "--data", tmp_path / "d", *TRAIN, timeout=300)
    lines = own_lines(proc.stderr)
    assert proc.returncode == 2 and len(lines) == 1 and "one class" in lines[0], proc.stderr
