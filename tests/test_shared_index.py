"""One index file per node, mapped by every process that reads the data set (issue 29).

A tree of 20,000 image names (hard links to one JPEG per class): the loader workers map the
training process's index file, so its pages are shared (counted once per node), not copied."""

import os
import pickle
from pathlib import Path

import numpy as np
import pytest

from hpcdl.data import Loader, open_dataset
from tools.bench.memory import make_names_tree, mapping, smaps_rollup


@pytest.fixture(scope="module")
def names_tree(tmp_path_factory) -> Path:
    tree = tmp_path_factory.mktemp("names") / "tree"
    make_names_tree(tree, 20_000, 100)
    return tree


def test_loader_workers_map_the_index_file_shared_not_copied(names_tree):
    ds = open_dataset(names_tree)
    assert len(ds) == 20_000 and ds.index_path is not None
    names_kb = ds.files.names.nbytes // 1024
    with Loader(ds, 8, workers=2, augment="rrc64+flip") as loader:
        batches = [np.arange(i, 20_000, 2_500)[:8] for i in range(4)]
        assert sum(len(y) for _, y in loader.iterate(batches, 0)) == 32
        for pid in [os.getpid(), *loader.worker_pids]:
            m = mapping(pid, str(ds.index_path))
            assert m is not None, f"process {pid} does not map {ds.index_path}"
            assert m["Rss"] >= names_kb  # every name was read (checked) through the mapping
            assert m["Private_Dirty"] == 0 and m["Anonymous"] == 0  # not written, not copied
            assert m["Shared_Clean"] >= names_kb  # the same pages in the other processes
            assert m["Pss"] < m["Rss"]
            pss, uss = smaps_rollup(pid)
            assert 0 < uss < pss + 1  # smaps_rollup parsed: USS is part of the whole


def test_a_mapped_file_table_pickles_as_its_file_not_its_names(names_tree):
    ds = open_dataset(names_tree)
    data = pickle.dumps(ds.files)
    assert len(data) < 1000 < ds.files.names.nbytes
    table = pickle.loads(data)
    assert len(table) == 20_000 and table[12_345] == ds.files[12_345]
    assert table.relpath(0) == "c0000/c0000_0000000.JPEG"
    assert np.array_equal(table.sizes, ds.files.sizes)


def test_cache_dirs_and_the_index_file_get_their_modes_whatever_the_umask(tmp_path, monkeypatch):
    from helpers import make_folder  # noqa: PLC0415

    make_folder(tmp_path / "data")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg" / "cache"))
    old = os.umask(0)
    try:
        ds = open_dataset(tmp_path / "data")
    finally:
        os.umask(old)
    assert ds.index_path.stat().st_mode & 0o777 == 0o444
    for d in (tmp_path / "xdg", tmp_path / "xdg" / "cache", ds.index_path.parent):
        assert d.stat().st_mode & 0o777 == 0o700, d
