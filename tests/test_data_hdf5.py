"""HDF5 data sets: opening, metadata, reads equal direct h5py reads, locate redirects, bad input."""

import json
import shutil

import h5py
import numpy as np
import pytest

from hpcdl.data import DataError, Loader, open_dataset


def write_shard(path, images, labels, **attrs):
    with h5py.File(path, "w") as f:
        f.create_dataset("images", data=images, **attrs.pop("ds_kwargs", {}))
        f.create_dataset("labels", data=labels)
        for k, v in attrs.items():
            f.attrs[k] = v


@pytest.fixture
def shards(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (250, 6, 5, 3), dtype=np.uint8)
    y = rng.integers(0, 4, 250)
    d = tmp_path / "shards"
    d.mkdir()
    for k, s in enumerate(range(0, 250, 100)):
        write_shard(
            d / f"part-{k}.h5",
            x[s : s + 100],
            y[s : s + 100],
            classes=json.dumps(list("abcd")),
            mean=[1.0, 2.0, 3.0],
            std=[2.0, 4.0, 8.0],
        )
    return d, x, y


def test_shard_directory_metadata_and_file_ids(shards):
    d, x, y = shards
    ds = open_dataset(d)
    assert len(ds) == 250 and ds.sample_shape == (3, 6, 5)
    assert ds.classes == list("abcd") and ds.num_classes == 4
    assert ds.root == d and [f.relpath for f in ds.files] == ["part-0.h5", "part-1.h5", "part-2.h5"]
    assert all(f.size == (d / f.relpath).stat().st_size for f in ds.files)
    assert ds.file_ids([0, 99, 100, 249]).tolist() == [0, 0, 1, 2]
    np.testing.assert_array_equal(ds.mean, [1, 2, 3])


def test_loader_batches_equal_direct_reads(shards):
    d, x, y = shards
    ds = open_dataset(d)
    idx = np.array([249, 3, 100, 101, 5, 199, 0])
    with Loader(ds, 7) as loader:
        ((images, labels),) = list(loader.iterate([idx], 0, train=False))
        stats = loader.stats()
    expect = (x[idx].astype(np.float32) - [1, 2, 3]) / np.float32([2, 4, 8])
    np.testing.assert_allclose(images, expect.transpose(0, 3, 1, 2), rtol=1e-6)
    np.testing.assert_array_equal(labels, y[idx])
    assert stats["pfs_reads"] == 7 and stats["local_reads"] == 0


@pytest.mark.parametrize("spec,resize", [("rrc4+flip", 4), ("rcrop4", None)])
def test_validation_crops_of_uint8_samples_are_torchvisions(shards, spec, resize):
    """6x5 samples: rrc4 validates on a resize to shorter side int(4 / 0.875) = 4 (5x4), then
    the centre 4x4; rcrop4 on the centre 4x4 (the shape the training crops have)."""
    from helpers import torchvision_eval  # noqa: PLC0415

    d, x, y = shards
    ds = open_dataset(d)
    idx = np.array([7, 120, 249])
    with Loader(ds, 3, augment=spec) as loader:
        assert loader.sample_shape == (3, 4, 4)
        ((images, labels),) = list(loader.iterate([idx], 0, train=False))
    want = np.stack([torchvision_eval(x[i], 4, resize) for i in idx]).astype(np.float32)
    want = (want - [1, 2, 3]) / np.float32([2, 4, 8])
    np.testing.assert_allclose(images, want.transpose(0, 3, 1, 2), rtol=1e-6)
    np.testing.assert_array_equal(labels, y[idx])


def test_chunked_compressed_and_float_chw_files_read_through_h5py(tmp_path):
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, (50, 4, 4, 1), dtype=np.uint8)
    write_shard(
        tmp_path / "c.h5",
        x,
        np.arange(50) % 3,
        ds_kwargs=dict(chunks=(7, 4, 4, 1), compression="gzip"),
    )
    ds = open_dataset(tmp_path / "c.h5")
    idx = np.array([40, 1, 2, 3, 17])
    ((images, _),) = list(Loader(ds, 5).iterate([idx], 0, train=False))
    np.testing.assert_allclose(images[:, 0], x[idx, ..., 0] / np.float32(255), rtol=1e-6)
    f = rng.standard_normal((20, 2, 3, 3)).astype(np.float32)
    write_shard(tmp_path / "f.h5", f, np.zeros(20, np.int64))
    ds = open_dataset(tmp_path / "f.h5")
    assert ds.sample_shape == (2, 3, 3)
    ((images, _),) = list(Loader(ds, 3).iterate([[5, 0, 19]], 0, train=False))
    np.testing.assert_array_equal(images, f[[5, 0, 19]])


def test_locate_redirects_reads_and_falls_back_to_the_pfs(shards, tmp_path):
    d, x, y = shards
    ds = open_dataset(d)
    local = tmp_path / "local"
    local.mkdir()
    shutil.copy(d / "part-1.h5", local / "part-1.h5")
    (local / "part-2.h5").write_bytes(b"truncated copy")  # unusable staged copy

    def locate(fid):
        return local / ds.files[fid].relpath if fid else d / ds.files[fid].relpath

    idx = np.array([0, 150, 210])
    with Loader(ds, 3, locate=locate) as loader:
        ((images, labels),) = list(loader.iterate([idx], 0, train=False))
        assert loader.stats()["local_reads"] == 1 and loader.stats()["pfs_reads"] == 2
    np.testing.assert_array_equal(labels, y[idx])


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda p: None, "no such file"),
        (lambda p: p.write_bytes(b"not hdf5"), "not a readable HDF5 file"),
        (
            lambda p: write_shard(p, np.zeros((3, 2, 2, 1), np.uint8), np.zeros(2, np.int64)),
            "'labels' has 2 entries but 'images' has 3",
        ),
        (
            lambda p: write_shard(p, np.zeros((3, 2, 2, 1), np.int32), np.zeros(3, np.int64)),
            "field 'images' is int32",
        ),
        (
            lambda p: write_shard(
                p,
                np.zeros((3, 2, 2, 1), np.uint8),
                np.array([0, 1, 5]),
                classes=json.dumps(["a", "b"]),
            ),
            "holds 5 at sample 2",
        ),
    ],
)
def test_bad_input_names_the_file_and_field(tmp_path, make, message):
    p = tmp_path / "bad.h5"
    make(p)
    with pytest.raises(DataError, match=message) as info:
        open_dataset(p)
    assert str(p) in str(info.value)


def test_missing_images_dataset(tmp_path):
    p = tmp_path / "x.h5"
    with h5py.File(p, "w") as f:
        f["labels"] = np.zeros(3, np.int64)
    with pytest.raises(DataError, match=r"x.h5: no 'images' dataset"):
        open_dataset(p)
    assert isinstance(DataError("x"), ValueError)


def test_shard_symlink_escaping_the_directory_is_refused(shards, tmp_path):
    d, _, _ = shards
    (tmp_path / "elsewhere").mkdir()
    shutil.move(d / "part-2.h5", tmp_path / "elsewhere" / "part-2.h5")
    (d / "part-2.h5").symlink_to(tmp_path / "elsewhere" / "part-2.h5")
    with pytest.raises(DataError, match=r"'part-2.h5'.*outside") as info:
        open_dataset(d)
    assert "\n" not in str(info.value)
    (d / "part-2.h5").unlink()
    (d / "part-3.h5").symlink_to(d / "part-1.h5")  # a link inside the directory is fine
    assert [f.relpath for f in open_dataset(d).files][-1] == "part-3.h5"


@pytest.mark.parametrize("char", ["\n", "\t"])
def test_shard_name_with_a_control_character_is_refused(shards, char):
    d, _, _ = shards
    (d / "part-1.h5").rename(d / f"part{char}1.h5")
    with pytest.raises(DataError, match=r"control character.*rename") as info:
        open_dataset(d)
    assert repr(f"part{char}1.h5")[1:-1] in str(info.value)
