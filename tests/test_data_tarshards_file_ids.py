"""Issue 62: TarShardDataset.file_ids, whose whole-epoch lookups (the planner, the dry run) use a
sample -> shard table: the same shard ids as the per-index search, empty shards included."""

from __future__ import annotations

import numpy as np
import pytest
from tarshards_helpers import jpeg_bytes, write_tar

from hpcdl.data import open_dataset, tarshards
from hpcdl.data.dataset import file_ids_from_offsets


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def uneven_shards(root, counts: list[int]) -> None:
    """One shard per count, of that many samples; a count of 0 is a shard of captions only."""
    key = 0
    for s, count in enumerate(counts):
        members = [(f"{key + i:05d}.jpg", jpeg_bytes(key + i)) for i in range(count)]
        members += [(f"{key + i:05d}.cls", b"%d" % (i % 3)) for i in range(count)]
        members += [] if count else [(f"{key:05d}x.txt", b"a caption, no image")]
        write_tar(root / f"s-{s:04d}.tar", sorted(members))
        key += max(count, 1)


def test_a_whole_epoch_gets_the_shard_ids_of_the_per_index_search(tmp_path, monkeypatch):
    uneven_shards(tmp_path / "data", [3, 0, 5, 1, 0, 4])
    ds = open_dataset(tmp_path / "data")
    perm = np.random.default_rng(0).permutation(len(ds))
    search = file_ids_from_offsets(ds.offsets, perm, len(ds))
    assert np.array_equal(ds.file_ids(perm), search)  # below the bulk size: the search itself
    monkeypatch.setattr(tarshards, "BULK_FILE_IDS", 4)
    bulk = ds.file_ids(perm)
    assert bulk.dtype == np.int64 and np.array_equal(bulk, search)
    assert ds._shard_of_sample is not None  # the table answered
    assert sorted(set(bulk.tolist())) == [0, 2, 3, 5]  # the caption-only shards have no sample
    for bad in ([0, 1, 2, len(ds)], [-1, 0, 1, 2]):
        with pytest.raises(IndexError, match="out of range"):
            ds.file_ids(np.array(bad))
