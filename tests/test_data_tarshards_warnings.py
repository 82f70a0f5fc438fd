"""A shard cut inside a tar header, or a zero-byte shard (a failed copy), is one warning line
naming it in every run: built or mapped from the cache, in hpcdl.train, inspect and the dry run."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from helpers import mpi_env, run_train, stage_cli
from tarshards_helpers import make_shards

from hpcdl.data import open_dataset


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def cut_shards(tmp_path: Path) -> tuple[Path, Path]:
    """d/: 4 shards of 4 samples; s-0001.tar cut inside its third member's header."""
    make_shards(tmp_path / "d", shards=4, per_shard=4)
    shard = tmp_path / "d" / "s-0001.tar"
    with tarfile.open(shard) as tar:
        member = tar.getmember("k00006.jpg")
    os.truncate(shard, member.offset + 100)
    return tmp_path / "d", shard


def warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if "warning" in line]


def inspect(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hpcdl.data", "inspect", str(path)],
        capture_output=True, text=True, env=mpi_env(), timeout=120,
    )  # fmt: skip


def test_a_truncated_shard_is_warned_about_when_the_index_comes_from_the_cache(tmp_path, capsys):
    data, shard = cut_shards(tmp_path)
    for source in ("built", "cache", "cache"):
        ds = open_dataset(data)
        assert ds.index_source == source and len(ds) == 14
        lines = warnings(capsys.readouterr().err)
        assert len(lines) == 1 and f"{shard} is truncated or damaged at byte" in lines[0]
    for _ in range(2):
        proc = inspect(data)
        assert proc.returncode == 0, proc.stderr
        lines = warnings(proc.stderr)
        assert len(lines) == 1 and f"{shard} is truncated" in lines[0]
        assert "14 in 4 file(s)" in proc.stdout


def test_a_zero_byte_shard_is_one_warning_naming_it_in_every_run(tmp_path, capsys):
    make_shards(tmp_path / "d", shards=4, per_shard=3)
    empty = tmp_path / "d" / "s-0002.tar"
    empty.write_bytes(b"")
    for source in ("built", "cache"):
        ds = open_dataset(tmp_path / "d")
        assert ds.index_source == source and len(ds) == 9
        lines = warnings(capsys.readouterr().err)
        assert len(lines) == 1 and f"{empty} is empty (0 bytes" in lines[0]
        assert "restore" in lines[0]


def test_hpcdl_train_and_the_dry_run_warn_in_every_run(tmp_path):
    data, shard = cut_shards(tmp_path)
    env = mpi_env()
    for _ in range(2):  # the second run maps the first one's index
        proc = run_train(1, "--data", data, "--model", "mlp", "--epochs", 1, "--batch-size", 2,
                         "--quiet", env=env, timeout=300)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        lines = warnings(proc.stderr)
        assert len(lines) == 1 and f"{shard} is truncated" in lines[0], proc.stderr
    dry = stage_cli("--dry-run", "--data", data, "--batch-size", 2, env=env)
    assert dry.returncode == 0, dry.stderr
    assert len(warnings(dry.stderr)) == 1 and f"{shard} is truncated" in dry.stderr
