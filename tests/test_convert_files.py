"""Conversions that keep each image file's bytes (issue 62 item 2): encoded HDF5 shards load
bitwise as the folder they came from (CPU decode and the `--decode gpu` bytes), tar shards have
WebDataset's layout, --shard-size takes samples or bytes, bad input is one line."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import h5py
import numpy as np
import pytest
from PIL import Image

from hpcdl.data import Loader, open_dataset
from hpcdl.data.__main__ import main
from hpcdl.data.convert import write_dataset
from hpcdl.data.convert_files import ShardSize, parse_shard_size
from hpcdl.data.dataset import BadSample, DataError
from hpcdl.data.file_bytes import FileBytesReader, byte_capacity

SEED, AUG = 5, "rrc24+flip"


def image_bytes(rng, h: int, w: int, fmt: str, mode: str = "RGB") -> bytes:
    out = io.BytesIO()
    pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    Image.fromarray(pixels).convert(mode).save(out, fmt, quality=90)
    return out.getvalue()


@pytest.fixture
def folder(tmp_path) -> Path:
    """Three classes of JPEGs of mixed sizes (draft decodes happen), a PNG, upper-case suffixes."""
    rng = np.random.default_rng(0)
    root = tmp_path / "src"
    for c, name in enumerate(("ant", "bee", "cow")):
        (root / name).mkdir(parents=True)
        for k in range(7):
            h, w = int(rng.integers(30, 120)), int(rng.integers(30, 120))
            (root / name / f"{k:02d}.JPEG").write_bytes(image_bytes(rng, h, w, "JPEG"))
        (root / name / "z.png").write_bytes(image_bytes(rng, 40 + c, 50, "PNG"))
    return root


def convert(*args: str) -> None:
    assert main(["convert", "folder", *map(str, args)]) == 0


def batches(ds, order, epoch: int, train: bool, workers: int = 0, decode: str = "cpu"):
    with Loader(ds, 6, workers=workers, seed=SEED, augment=AUG, decode=decode) as loader:
        return [(x.copy(), y.copy()) for x, y in loader.iterate(order, epoch, train=train)]


def assert_same(a, b) -> None:
    assert len(a) == len(b)
    for (x, y), (wx, wy) in zip(a, b):
        assert x.dtype == wx.dtype and np.array_equal(x, wx) and np.array_equal(y, wy)


def test_encoded_hdf5_loads_bitwise_as_the_folder(folder, tmp_path):
    convert(folder, tmp_path / "enc", "--encoded", "--shard-size", "5")
    enc, ds = open_dataset(tmp_path / "enc" / "train"), open_dataset(folder)
    assert enc.kind == "hdf5-encoded" and len(enc.files) == 5 and len(enc) == len(ds) == 24
    assert enc.classes == ds.classes and np.array_equal(enc.labels, ds.labels)
    assert enc.sample_shape == ds.sample_shape
    assert np.array_equal(enc.mean, ds.mean) and np.array_equal(enc.std, ds.std)
    order = [np.random.default_rng(1).permutation(24)[k : k + 6] for k in range(0, 24, 6)]
    for epoch, train in ((0, True), (3, True), (0, False)):
        assert_same(batches(enc, order, epoch, train), batches(ds, order, epoch, train))
    assert_same(batches(enc, order, 2, True, workers=2), batches(ds, order, 2, True))


def test_encoded_rows_are_the_files_bytes_for_decode_gpu(folder, tmp_path):
    convert(folder, tmp_path / "enc", "--encoded", "--shard-size", "4kB")
    enc, ds = open_dataset(tmp_path / "enc" / "train"), open_dataset(folder)
    assert byte_capacity(enc, 3) == byte_capacity(ds, 3)  # the largest file, not a shard
    indices = np.array([23, 0, 9, 10, 4])
    offsets = np.empty(6, np.int64)
    data, labels = np.empty(byte_capacity(enc, 5), np.uint8), np.empty(5, np.int64)
    FileBytesReader(enc).read(indices, labels, offsets, data)
    for i, index in enumerate(indices):
        want = (folder / ds.files.relpath(int(index))).read_bytes()
        assert bytes(data[offsets[i] : offsets[i + 1]]) == want
    assert np.array_equal(labels, ds.labels[indices])
    order = [np.arange(k, k + 6) for k in range(0, 24, 6)]
    assert_same(
        batches(enc, order, 1, True, workers=1, decode="gpu"),
        batches(ds, order, 1, True, decode="gpu"),
    )


def test_a_corrupt_encoded_image_is_a_bad_sample_naming_shard_and_row(folder, tmp_path):
    (folder / "bee" / "03.JPEG").write_bytes(b"\xff\xd8 not really a JPEG")
    convert(folder, tmp_path / "enc", "--encoded", "--shard-size", "10")
    enc = open_dataset(tmp_path / "enc" / "train")
    index = open_dataset(folder).files.relpaths(np.arange(24)).index("bee/03.JPEG")
    assert index == 11 and enc.heights[index] == 0
    with pytest.raises(BadSample) as err:
        batches(enc, [np.array([0, index])], 0, True)
    shard = tmp_path / "enc" / "train" / "part-00001.h5"
    assert f"sample {index} in {shard} cannot be read: row 1 of 'encoded':" in str(err.value)
    with Loader(enc, 2, seed=SEED, augment=AUG, skip_bad_samples=True) as loader:
        list(loader.iterate([np.array([0, index])], 0))
        assert loader.stats()["bad_samples"] == 1


def test_tar_shards_hold_the_files_and_labels_in_the_folders_order(folder, tmp_path):
    out = tmp_path / "tar"
    convert(folder, out, "--to", "tar", "--shard-size", "10")
    ds = open_dataset(folder)
    shards = sorted(out.glob("shard-*.tar"))
    assert [p.name for p in shards] == ["shard-000000.tar", "shard-000001.tar", "shard-000002.tar"]
    assert json.loads((out / "classes.json").read_text()) == ["ant", "bee", "cow"]
    members = []
    for shard in shards:
        with tarfile.open(shard) as tar:
            members += [(m.name, tar.extractfile(m).read()) for m in tar.getmembers()]
    assert len(members) == 48 and not list(out.glob(".hpcdl-convert-*"))
    for i, rel in enumerate(ds.files.relpaths(np.arange(24))):
        (image_name, data), (label_name, label) = members[2 * i : 2 * i + 2]
        assert image_name == f"{i:09d}{Path(rel).suffix.lower()}" and label_name == f"{i:09d}.cls"
        assert data == (folder / rel).read_bytes() and label == str(ds.labels[i]).encode()


def test_shard_size_in_bytes_and_bad_values(folder, tmp_path, capsys):
    assert parse_shard_size("1000") == ShardSize(samples=1000)
    assert parse_shard_size("256MB") == ShardSize(bytes=256 * 10**6)
    assert parse_shard_size("1GiB") == ShardSize(bytes=1 << 30)
    assert parse_shard_size("1.5kB") == ShardSize(bytes=1500)
    sizes = sorted(p.stat().st_size for p in folder.rglob("*.*"))
    convert(folder, tmp_path / "tar", "--to", "tar", "--shard-size", f"{sizes[-1] + 1024}B")
    for shard in (tmp_path / "tar").glob("*.tar"):  # payload and headers within the limit
        assert shard.stat().st_size <= sizes[-1] + 1024 + 10240  # + tar's end-of-archive blocks
    assert len(list((tmp_path / "tar").glob("*.tar"))) >= 24 * sizes[0] // (sizes[-1] + 1024)
    for bad in ("0", "12XB", "-5", "1.5", "MB"):
        capsys.readouterr()
        rc = main(
            ["convert", "folder", str(folder), str(tmp_path / f"o{bad}"), "--shard-size", bad]
        )
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1 and "--shard-size" in err and repr(bad) in err
        assert not (tmp_path / f"o{bad}").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (("{src}/sub", "--to", "tar"), "is inside the data set"),
        (("{out}", "--to", "tar", "--val-fraction", "0.2"), "--to tar writes one split"),
        (("{out}", "--encoded", "--resize", "8"), "--resize needs decoded shards"),
        (("{exists}", "--to", "tar"), "classes.json already exists"),
        (("{exists}", "--encoded"), "train already exists"),
    ],
)
def test_bad_conversions_are_one_line_and_write_nothing(folder, tmp_path, capsys, args, message):
    exists = tmp_path / "exists"
    (exists / "train").mkdir(parents=True)
    (exists / "train" / "x").write_text("mine")
    (exists / "classes.json").write_text("[]")
    before = sorted(p for p in tmp_path.rglob("*"))
    words = [a.format(src=folder, out=tmp_path / "out", exists=exists) for a in args]
    assert main(["convert", "folder", str(folder), *words]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert sorted(p for p in tmp_path.rglob("*")) == before


def test_encoded_and_pixel_shards_do_not_mix(folder, tmp_path):
    write_dataset(
        tmp_path / "mixed", {"train": (np.zeros((2, 4, 4, 3), np.uint8), np.zeros(2))}, ["a"]
    )
    convert(folder, tmp_path / "enc", "--encoded")
    (tmp_path / "enc" / "train" / "part-00000.h5").rename(
        tmp_path / "mixed" / "train" / "part-00001.h5"
    )
    with pytest.raises(DataError, match="part-00001.h5: holds encoded image files but the first"):
        open_dataset(tmp_path / "mixed" / "train")


def test_training_on_encoded_shards_ends_with_the_folders_parameters(folder, tmp_path):
    """hpcdl.train, one process, two loader workers: same seed and --augment, same bits."""
    convert(folder, tmp_path / "enc", "--encoded", "--shard-size", "7")
    params = []
    for data, run in ((folder, "folder"), (tmp_path / "enc" / "train", "encoded")):
        cmd = [sys.executable, "-m", "hpcdl.train", "--data", str(data), "--model", "cnn"]
        cmd += ["--augment", AUG, "--batch-size", "6", "--epochs", "2", "--workers", "2"]
        cmd += ["--seed", str(SEED), "--checkpoint-dir", str(tmp_path / run), "--quiet"]
        subprocess.run(cmd, check=True, capture_output=True, timeout=300)
        (last,) = sorted((tmp_path / run).glob("ckpt-e00002-*.h5"))
        with h5py.File(last) as f:
            params.append(f["params"][()])
    assert params[0].dtype == params[1].dtype and np.array_equal(params[0], params[1])


def test_shard_size_in_bytes_for_decoded_pixels(tmp_path):
    """Digits: 8 x 8 x 1 bytes a sample, 1,438 training samples; 40kB -> 625 per shard."""
    assert main(["convert", "digits", str(tmp_path / "d"), "--shard-size", "40kB"]) == 0
    shards = sorted((tmp_path / "d" / "train").glob("*.h5"))
    assert [len(h5py.File(p)["labels"]) for p in shards] == [625, 625, 188]


def test_encoded_shards_read_staged_copies_and_fall_back_to_the_pfs(folder, tmp_path):
    convert(folder, tmp_path / "enc", "--encoded", "--shard-size", "10")
    pfs, local = tmp_path / "enc" / "train", tmp_path / "local"
    enc = open_dataset(pfs)
    local.mkdir()
    (local / "part-00001.h5").write_bytes((pfs / "part-00001.h5").read_bytes())
    (local / "part-00002.h5").write_bytes(b"truncated copy")  # unusable: read the PFS's

    def locate(fid: int) -> Path:
        return (local if fid else pfs) / enc.files.relpath(fid)

    order = [np.array([0, 12, 21])]
    with Loader(enc, 3, seed=SEED, augment=AUG, locate=locate) as loader:
        got = [(x.copy(), y.copy()) for x, y in loader.iterate(order, 0)]
        assert loader.stats()["local_reads"] == 1 and loader.stats()["pfs_reads"] == 2
    assert_same(got, batches(open_dataset(folder), order, 0, True))


def test_damaged_encoded_shards_name_the_shard(folder, tmp_path):
    convert(folder, tmp_path / "enc", "--encoded", "--shard-size", "10")
    shard = tmp_path / "enc" / "train" / "part-00001.h5"
    reader = open_dataset(shard.parent).reader()
    reader.decode(10)  # the shard is open
    with open(shard, "r+b") as f:  # and shrinks while the job reads it
        f.truncate(shard.stat().st_size // 2)
    with pytest.raises(BadSample, match=r"sample 19 in .*part-00001.h5 cannot be read: row 9 "):
        reader.decode(19)
    reader.close()
    (tmp_path / "enc" / "train" / "part-00001.h5").unlink()
    with h5py.File(tmp_path / "enc" / "train" / "part-00000.h5", "r+") as f:
        f["encoded_offsets"][3] = 10**9
    with pytest.raises(DataError, match="part-00000.h5: field 'encoded_offsets' must rise"):
        open_dataset(shard.parent)
