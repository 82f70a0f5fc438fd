"""A directory holding both HDF5 shards and tar shards is refused in one line naming both kinds,
as compressed shards beside plain ones are: either kind's samples would be left out unsaid."""

from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np
import pytest
from helpers import mpi_env
from tarshards_helpers import make_shards

from hpcdl.data import DataError, open_dataset, open_listing
from hpcdl.data.convert import write_dataset


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def test_hdf5_and_tar_shards_in_one_directory_are_one_line_naming_both(tmp_path):
    make_shards(tmp_path / "d", shards=2, per_shard=3)
    x = np.random.default_rng(0).integers(0, 256, (12, 8, 8, 3), dtype=np.uint8)
    (h5_dir,) = write_dataset(tmp_path / "h5", {"train": (x, np.arange(12) % 3)}, ["a", "b", "c"])
    shutil.copy(next(h5_dir.glob("*.h5")), tmp_path / "d" / "part-00000.h5")
    for opener in (open_dataset, open_listing):
        with pytest.raises(DataError) as err:
            opener(tmp_path / "d")
        line = str(err.value)
        assert "\n" not in line and "part-00000.h5" in line and "s-0000.tar" in line
        assert "HDF5" in line and "tar" in line
    proc = subprocess.run(
        [sys.executable, "-m", "hpcdl.data", "inspect", str(tmp_path / "d")],
        capture_output=True, text=True, env=mpi_env(), timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and proc.stdout == "" and proc.stderr.count("\n") == 1
    assert "part-00000.h5" in proc.stderr and "s-0000.tar" in proc.stderr
    (tmp_path / "d" / "part-00000.h5").unlink()
    assert open_dataset(tmp_path / "d").kind == "tar"  # the tar shards alone are read
    assert open_dataset(h5_dir).kind == "hdf5"
