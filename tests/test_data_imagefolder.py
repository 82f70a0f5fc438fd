"""Image folder data sets: index cache, re-indexing, decoded reads equal direct Pillow reads."""

import os

import numpy as np
import pytest
from PIL import Image

from hpcdl.data import BadSample, DataError, Loader, open_dataset


def make_folder(root, per_class=3, size=(20, 16), classes=("cat", "dog"), fmt="png", seed=0):
    """root/<class>/<i>.<fmt> random RGB images (w, h) = size; returns {relpath: HWC array}."""
    rng = np.random.default_rng(seed)
    images = {}
    for c in classes:
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            arr = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
            rel = f"{c}/{i}.{fmt}"
            Image.fromarray(arr).save(root / rel, quality=95)
            images[rel] = np.asarray(Image.open(root / rel).convert("RGB"))
    return images


def test_index_is_built_once_cached_and_rebuilt_when_the_tree_changes(tmp_path):
    images = make_folder(tmp_path / "data")
    ds = open_dataset(tmp_path / "data")
    assert ds.kind == "folder" and len(ds) == 6 and ds.classes == ["cat", "dog"]
    assert ds.sample_shape == (3, 16, 20)
    assert [f.relpath for f in ds.files] == sorted(images)
    assert ds.labels.tolist() == [0, 0, 0, 1, 1, 1]
    assert ds.index_path == tmp_path / "data" / ".hpcdl-index.npz"
    assert ds.file_ids([5, 0]).tolist() == [5, 0]
    mtime = ds.index_path.stat().st_mtime_ns
    assert len(open_dataset(tmp_path / "data")) == 6
    assert ds.index_path.stat().st_mtime_ns == mtime  # cache hit, not rewritten
    Image.fromarray(np.zeros((16, 20, 3), np.uint8)).save(tmp_path / "data" / "dog" / "new.png")
    assert len(open_dataset(tmp_path / "data")) == 7


def test_unwritable_root_caches_in_the_user_cache_dir(tmp_path, monkeypatch):
    make_folder(tmp_path / "data")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "data" / ".hpcdl-index.npz").mkdir()  # root side unwritable (even for root)
    ds = open_dataset(tmp_path / "data")
    assert ds.index_path.parent == tmp_path / "cache" / "hpcdl"


def test_reads_equal_direct_decodes(tmp_path):
    images = make_folder(tmp_path / "d", fmt="jpg")
    ds = open_dataset(tmp_path / "d")
    idx = np.array([4, 0, 5])
    for workers in (0, 2):
        with Loader(ds, 3, workers=workers) as loader:
            ((x, y),) = list(loader.iterate([idx], 0, train=False))
            want = np.stack([images[ds.files[i].relpath] for i in idx]).astype(np.float32)
            want = (want - ds.mean) / ds.std
            np.testing.assert_allclose(x, want.transpose(0, 3, 1, 2), rtol=1e-5, atol=1e-5)
            assert y.tolist() == [1, 0, 1]


def test_mixed_sizes_centre_crop_to_the_smallest(tmp_path):
    make_folder(tmp_path / "d", size=(20, 16), classes=("a",))
    make_folder(tmp_path / "d", size=(11, 30), classes=("b",), seed=1)
    ds = open_dataset(tmp_path / "d")
    assert ds.sample_shape == (3, 16, 11)
    ((x, _),) = list(Loader(ds, 6).iterate([np.arange(6)], 0, train=False))
    assert x.shape == (6, 3, 16, 11)


def write_corrupt_jpeg(path):
    arr = np.random.default_rng(0).integers(0, 256, (16, 20, 3), dtype=np.uint8)
    Image.fromarray(arr).save(path, quality=95)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # header intact, entropy-coded data cut


@pytest.mark.parametrize("workers", [0, 2])
def test_corrupt_jpeg_names_file_and_index_or_is_skipped_and_counted(tmp_path, workers):
    make_folder(tmp_path / "d", fmt="jpg")
    write_corrupt_jpeg(tmp_path / "d" / "cat" / "1.jpg")
    ds = open_dataset(tmp_path / "d")
    bad = [f.relpath for f in ds.files].index("cat/1.jpg")
    with Loader(ds, 6, workers=workers) as loader:
        with pytest.raises(DataError, match=rf"sample {bad} in .*cat/1.jpg"):
            list(loader.iterate([np.arange(6)], 0))
    with Loader(ds, 6, workers=workers, skip_bad_samples=True) as loader:
        ((x, y),) = [(a.copy(), b.copy()) for a, b in loader.iterate([np.arange(6)], 0)]
        assert loader.stats()["bad_samples"] == 1
    np.testing.assert_array_equal(x[bad], x[bad - 1])  # the previous good sample stands in
    assert y[bad] == y[bad - 1]


def test_empty_folder_and_unreadable_header(tmp_path):
    (tmp_path / "e" / "cls").mkdir(parents=True)
    with pytest.raises(DataError, match="no images found"):
        open_dataset(tmp_path / "e")
    make_folder(tmp_path / "g", per_class=1, classes=("a",))
    (tmp_path / "g" / "a" / "junk.png").write_bytes(b"not an image")
    ds = open_dataset(tmp_path / "g")
    with pytest.raises(BadSample, match="junk.png"):
        ds.reader().decode([f.relpath for f in ds.files].index("a/junk.png"))
    assert os.path.exists(tmp_path / "g" / ".hpcdl-index.npz")
