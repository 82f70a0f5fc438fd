"""`python -m tools.bench memory --layout tar`: the ImageNet-sized tar set it makes (issue 62)."""

from __future__ import annotations

import numpy as np

from hpcdl.data import open_dataset
from tools.bench.memory import make_tar_names


def test_the_tar_set_is_hard_linked_shards_that_open_as_samples_with_their_labels(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root = tmp_path / "tar-names"
    make_tar_names(root, files=10, classes=3, shards=3)
    shards = sorted(root.glob("*.tar"))
    assert len(shards) == 3 and {s.stat().st_ino for s in shards} == {shards[0].stat().st_ino}
    ds = open_dataset(root)
    assert ds.kind == "tar" and len(ds) == 12  # ceil(10 / 3) = 4 samples a shard
    assert ds.classes == ["c0000", "c0001", "c0002"]
    assert np.array_equal(np.asarray(ds.labels), np.tile([0, 1, 2, 0], 3))
    make_tar_names(root, files=10, classes=3, shards=3)  # made once: kept as it is
    assert sorted(root.glob("*.tar")) == shards
