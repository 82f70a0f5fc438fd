"""The emulated PFS (HPCDL_STAGE_EMULATE_PFS) slows the loader's PFS reads, not local ones."""

import time

import numpy as np
import pytest
from helpers import make_folder

from hpcdl.data import Loader, open_dataset
from hpcdl.data.convert import write_dataset
from hpcdl.data.pfs import ENV, PfsEmulation


def _read_all(ds, locate=None) -> tuple[float, dict]:
    batches = [np.arange(len(ds))]
    with Loader(ds, len(ds), workers=0, locate=locate) as loader:
        t0 = time.perf_counter()
        for _ in loader.iterate(batches, 0, train=False):
            pass
        return time.perf_counter() - t0, loader.stats()


def test_image_folder_reads_pay_the_open_latency_on_the_pfs_only(tmp_path, monkeypatch):
    make_folder(tmp_path / "pfs", per_class=4)  # 8 files
    ds = open_dataset(tmp_path / "pfs")
    monkeypatch.setenv(ENV, "latency_ms=60")
    seconds, stats = _read_all(ds)
    assert stats["pfs_reads"] == 8 and stats["local_reads"] == 0
    assert seconds >= 8 * 0.060  # a lower bound: every PFS open slept

    staged = tmp_path / "stage"  # a local copy of every file: no emulated cost
    for f in ds.files:
        (staged / f.relpath).parent.mkdir(parents=True, exist_ok=True)
        (staged / f.relpath).write_bytes((ds.root / f.relpath).read_bytes())
    _, stats = _read_all(ds, locate=lambda i: staged / ds.files[i].relpath)
    assert stats["local_reads"] == 8 and stats["pfs_reads"] == 0


def test_hdf5_shard_reads_pay_latency_per_open_and_the_bandwidth_cap(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (400, 16, 16, 3), dtype=np.uint8)  # 307 KB in 4 shards
    write_dataset(tmp_path, {"train": (x, rng.integers(0, 10, 400))}, ["a"] * 10, shard_size=100)
    ds = open_dataset(tmp_path / "train")
    monkeypatch.setenv(ENV, "latency_ms=50,mbps=1")
    seconds, stats = _read_all(ds)
    assert stats["pfs_reads"] == 400
    assert seconds >= 4 * 0.050 + x.nbytes / 1e6 * 0.9  # 4 opens, ~0.3 s at 1 MB/s


def test_a_bad_emulation_spec_names_the_variable():
    with pytest.raises(ValueError, match=ENV):
        PfsEmulation.parse("latency=3")
