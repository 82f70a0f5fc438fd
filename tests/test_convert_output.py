"""A conversion's output directory: an OUT that is a file, and an OUT (or OUT/train) that
already holds what a reader would take in with the new data, are one line and rc 2, with
nothing written (hpcdl.data.convert_output)."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest

from hpcdl.data import open_dataset
from hpcdl.data.__main__ import main


@pytest.fixture
def sources(tmp_path) -> dict[str, Path]:
    """One small source per converter: an image folder, CIFAR-10 batches, an .npz."""
    from helpers import make_folder

    rng = np.random.default_rng(0)
    make_folder(tmp_path / "imgs", per_class=4, fmt="jpg")
    cifar = tmp_path / "cifar"
    cifar.mkdir()
    for name in ("data_batch_1", "test_batch"):
        with open(cifar / name, "wb") as f:
            data = rng.integers(0, 256, (4, 3 * 32 * 32), dtype=np.uint8)
            pickle.dump({b"data": data, b"labels": [0, 1, 0, 1]}, f)
    images = rng.integers(0, 256, (6, 5, 4, 3), dtype=np.uint8)
    np.savez(tmp_path / "a.npz", images=images, labels=np.arange(6) % 2)
    return {"folder": tmp_path / "imgs", "cifar": cifar, "npz": tmp_path / "a.npz"}


CONVERTERS = [
    ("digits",),
    ("folder",),
    ("folder", "--encoded"),
    ("folder", "--to", "tar"),
    ("cifar",),
    ("npz",),
]


def convert_args(sources: dict[str, Path], kind_and_flags: tuple[str, ...], out: Path):
    kind, *flags = kind_and_flags
    src = [] if kind == "digits" else [str(sources[kind])]
    return ["convert", kind, *src, str(out), *flags]


def assert_one_error_line(capsys, *words: str) -> str:
    err = capsys.readouterr().err
    assert err.startswith("hpcdl.data: error: ") and err.count("\n") == 1, err
    for word in words:
        assert word in err, err
    return err


@pytest.mark.parametrize("kind_and_flags", CONVERTERS, ids=" ".join)
def test_an_out_that_is_a_file_is_one_line_and_the_file_is_untouched(
    sources, tmp_path, capsys, kind_and_flags
):
    afile = tmp_path / "afile"
    afile.write_text("mine")
    for out in (afile, afile / "sub"):
        capsys.readouterr()
        assert main(convert_args(sources, kind_and_flags, out)) == 2
        assert_one_error_line(capsys, str(out))
        assert afile.is_file() and afile.read_text() == "mine"
    assert main(convert_args(sources, kind_and_flags, afile)) == 2
    assert "is a file, not a directory" in capsys.readouterr().err


@pytest.mark.parametrize("other", ["other.tar", "OTHER.TAR", "other.tar.gz", "x.h5", "y.hdf5"])
def test_tar_output_into_a_directory_holding_other_shards_is_refused(
    sources, tmp_path, capsys, other
):
    """--data OUT would read the new shards and the other file together (or, for an HDF5
    file, read that file alone): the conversion names it and writes nothing."""
    out = tmp_path / "out"
    assert main(convert_args(sources, ("folder", "--to", "tar"), tmp_path / "first")) == 0
    out.mkdir()
    (out / other).write_bytes((tmp_path / "first" / "shard-000000.tar").read_bytes())
    before = sorted(out.iterdir())
    capsys.readouterr()
    assert main(convert_args(sources, ("folder", "--to", "tar"), out)) == 2
    assert_one_error_line(capsys, str(out), other, f"--data {out}")
    assert sorted(out.iterdir()) == before
    (out / other).unlink()
    (out / "notes.txt").write_text("kept")  # a file no reader takes is fine beside the shards
    assert main(convert_args(sources, ("folder", "--to", "tar"), out)) == 0
    assert len(open_dataset(out)) == 8 and (out / "notes.txt").read_text() == "kept"


@pytest.mark.parametrize("kind_and_flags", [("folder",), ("folder", "--encoded")], ids=" ".join)
def test_hdf5_output_into_a_split_directory_holding_a_file_names_it(
    sources, tmp_path, capsys, kind_and_flags
):
    """OUT/train is the data set HDF5 outputs are read from: anything in it is refused, by
    name; an HDF5 file beside OUT/train is not read with it and stays."""
    out = tmp_path / "out"
    (out / "train").mkdir(parents=True)
    (out / "train" / "other.h5").write_bytes(b"not mine to touch")
    assert main(convert_args(sources, kind_and_flags, out)) == 2
    assert_one_error_line(capsys, str(out / "train"), "other.h5")
    assert sorted(p.name for p in out.rglob("*")) == ["other.h5", "train"]
    (out / "train" / "other.h5").rename(out / "other.h5")
    assert main(convert_args(sources, kind_and_flags, out)) == 0
    assert len(open_dataset(out / "train")) == 8
    assert (out / "other.h5").read_bytes() == b"not mine to touch"
