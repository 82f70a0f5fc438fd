"""hpcdl.bench train's synthetic-data cache under $TMPDIR: it writes and deletes only inside a
private directory of this user, never through a link or a directory someone else controls."""

import argparse
import os
import tempfile
from pathlib import Path

import pytest

from hpcdl.bench import train as bench_train


def args() -> argparse.Namespace:
    return argparse.Namespace(data=None, val_data=None, synthetic=20, format="h5", image_size=8)


@pytest.fixture
def tmpdir_env(tmp_path, monkeypatch):
    """$TMPDIR (what tempfile.gettempdir() answers) set to tmp_path/tmp, a sticky 1777 dir."""
    tmp = tmp_path / "tmp"
    tmp.mkdir(mode=0o1777)
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read $TMPDIR
    return tmp


def victim(tmp_path: Path) -> Path:
    """Someone's directory holding a file where the cache would put an incomplete data set."""
    theirs = tmp_path / "victim"
    (theirs / "synthetic-20-h5-8").mkdir(parents=True)
    (theirs / "synthetic-20-h5-8" / "thesis.tex").write_text("years of work")
    return theirs


def cache_names(tmp: Path) -> list[Path]:
    """The names the cache directory has had: shared (before the fix) and per user."""
    return [tmp / "hpcdl-bench-data", tmp / f"hpcdl-bench-data-{os.getuid()}"]


def test_a_planted_symlink_cache_directory_is_refused_and_nothing_is_deleted(tmpdir_env, tmp_path):
    theirs = victim(tmp_path)
    for name in cache_names(tmpdir_env):
        name.symlink_to(theirs)
    with pytest.raises(bench_train.CacheError, match="not a private directory"):
        bench_train.ensure_data(args())
    assert (theirs / "synthetic-20-h5-8" / "thesis.tex").read_text() == "years of work"
    assert sorted(p.name for p in theirs.iterdir()) == ["synthetic-20-h5-8"]


@pytest.mark.parametrize("owner_or_mode", ["other user", "open to others"])
def test_a_cache_directory_others_can_write_is_refused(tmpdir_env, tmp_path, owner_or_mode):
    for name in cache_names(tmpdir_env):
        name.mkdir(mode=0o700)
        (name / "synthetic-20-h5-8").mkdir()
        (name / "synthetic-20-h5-8" / "keep").write_text("x")
        if owner_or_mode == "other user":
            if os.getuid() != 0:
                pytest.skip("changing a directory's owner needs root")
            os.chown(name, 65534, 65534)
        else:
            name.chmod(0o777)
    with pytest.raises(bench_train.CacheError, match="not a private directory"):
        bench_train.ensure_data(args())
    for name in cache_names(tmpdir_env):
        assert (name / "synthetic-20-h5-8" / "keep").read_text() == "x"


def test_the_cache_is_made_private_and_reused(tmpdir_env):
    train, val = bench_train.ensure_data(args())
    root = Path(train).parent.parent
    assert root.stat().st_mode & 0o777 == 0o700 and root.stat().st_uid == os.getuid()
    assert sorted(p.name for p in Path(train).iterdir())  # the shards are there
    marker = Path(train).parent / ".complete"
    made = marker.stat().st_mtime_ns
    assert bench_train.ensure_data(args()) == (train, val)
    assert marker.stat().st_mtime_ns == made  # reused, not made again
