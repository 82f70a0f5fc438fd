"""--data shard patterns: only the numeric range {a..b}, counting up, of a sane size; anything
else (a range counting down, globs, {a,b} lists, lists of paths) is one line that says so."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import mpi_env
from tarshards_helpers import make_shards

from hpcdl.data import DataError, open_dataset
from hpcdl.data.kinds import kind_of
from hpcdl.data.tarindex import MAX_PATTERN_NAMES


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def inspect(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hpcdl.data", "inspect", str(path)],
        capture_output=True,
        text=True,
        env=mpi_env(),
        timeout=120,
    )


def test_a_range_counting_down_is_one_line_saying_how_to_write_it(tmp_path):
    make_shards(tmp_path / "d", shards=4, per_shard=2)
    pattern = tmp_path / "d" / "s-{0003..0000}.tar"
    with pytest.raises(DataError) as err:
        open_dataset(pattern)
    line = str(err.value)
    assert "\n" not in line and "counts down" in line and "{0000..0003}" in line
    proc = inspect(pattern)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and "{0000..0003}" in proc.stderr
    assert len(open_dataset(tmp_path / "d" / "s-{0000..0003}.tar")) == 8  # counting up: read


def test_a_descending_range_stops_hpcdl_train_in_one_line(tmp_path):
    make_shards(tmp_path / "d", shards=2, per_shard=4)
    proc = subprocess.run(
        [sys.executable, "-m", "hpcdl.train", "--data", str(tmp_path / "d" / "s-{0001..0000}.tar"),
         "--model", "mlp", "--epochs", "1", "--batch-size", "2", "--quiet"],
        capture_output=True, text=True, env=mpi_env(), timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and "counts down" in lines[0] and "{0000..0001}" in lines[0]
    assert "concatenate" not in proc.stderr


@pytest.mark.parametrize(
    ("name", "what"),
    [
        ("s-*.tar", "glob"),
        ("s-000?.tar", "glob"),
        ("s-[0-1].tar", "glob"),
        ("s-{0000,0001}.tar", "{a,b}"),
        ("s-0000.tar,s-0001.tar", "list"),
        ("s-0000.tar s-0001.tar", "list"),
    ],
)
def test_globs_lists_and_brace_lists_say_only_the_numeric_range_is_supported(name, what, tmp_path):
    make_shards(tmp_path / "d", shards=2, per_shard=2)
    with pytest.raises(DataError) as err:
        kind_of(tmp_path / "d" / name)
    line = str(err.value)
    assert "\n" not in line and "{a..b}" in line and "not supported" in line
    assert "glob" in line  # says globs are not expanded


def test_a_glob_beside_a_range_is_said_too(tmp_path):
    make_shards(tmp_path / "d", shards=2, per_shard=2)
    with pytest.raises(DataError, match=r"\{a\.\.b\}.*not supported"):
        open_dataset(tmp_path / "d" / "s-{0000..0001}*.tar")


def test_an_existing_name_with_a_space_or_comma_is_read_as_it_is(tmp_path):
    make_shards(tmp_path / "my data, v1", shards=1, per_shard=2)
    assert len(open_dataset(tmp_path / "my data, v1")) == 2


def test_shards_whose_names_hold_glob_characters_are_read_by_a_range(tmp_path):
    make_shards(tmp_path / "d", shards=2, per_shard=2)
    for i in range(2):
        (tmp_path / "d" / f"s-{i:04d}.tar").rename(tmp_path / "d" / f"s[x]-{i:04d}.tar")
    assert len(open_dataset(tmp_path / "d" / "s[x]-{0000..0001}.tar")) == 4


def test_a_range_of_too_many_names_is_refused_at_once(tmp_path):
    make_shards(tmp_path / "d", shards=1, per_shard=2)
    t0 = time.perf_counter()
    with pytest.raises(DataError) as err:
        open_dataset(tmp_path / "d" / "s-{0000000..1999999}.tar")
    assert time.perf_counter() - t0 < 1.0
    line = str(err.value)
    assert "2000000 names" in line and f"{MAX_PATTERN_NAMES}" in line and "\n" not in line
    with pytest.raises(DataError, match="names"):  # two ranges multiply
        open_dataset(tmp_path / "d" / "s-{0000..1999}-{0000..999}.tar")
