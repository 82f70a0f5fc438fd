"""Damaged HDF5 shards (edited with h5py) are one line that names the shard and what is wrong
with it: a missing dataset, a row that is no image, offsets of a float dtype, a later shard's
`classes` attribute that is not JSON or not the first shard's (hpcdl.data.hdf5,
hpcdl.data.hdf5_encoded)."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpcdl.data import open_dataset
from hpcdl.data.__main__ import main
from hpcdl.data.dataset import BadSample, DataError


@pytest.fixture
def encoded(tmp_path) -> Path:
    """12 JPEGs of 3 classes as encoded shards of 4: OUT/train/part-0000{0,1,2}.h5."""
    from helpers import make_folder

    make_folder(tmp_path / "imgs", per_class=4, fmt="jpg", classes=("a", "b", "c"))
    out = tmp_path / "enc"
    args = ["convert", "folder", str(tmp_path / "imgs"), str(out), "--encoded", "--shard-size"]
    assert main([*args, "4"]) == 0
    return out / "train"


@pytest.fixture
def pixels(tmp_path) -> Path:
    """The same folder as pixel shards of 4."""
    from helpers import make_folder

    make_folder(tmp_path / "imgs", per_class=4, fmt="jpg", classes=("a", "b", "c"))
    out = tmp_path / "px"
    assert main(["convert", "folder", str(tmp_path / "imgs"), str(out), "--shard-size", "4"]) == 0
    return out / "train"


def one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text and "object at 0x" not in text and "<_io." not in text, text
    return text


def test_a_shard_without_encoded_bytes_says_so_not_that_it_holds_images(encoded):
    with h5py.File(encoded / "part-00001.h5", "r+") as f:
        del f["encoded"]
    with pytest.raises(DataError) as err:
        open_dataset(encoded)
    text = one_line(err)
    assert f"{encoded / 'part-00001.h5'}: no 'encoded' dataset" in text, text
    assert "images" not in text and "encoded_offsets" in text  # what it does hold


def test_a_row_that_is_no_image_names_shard_and_row_without_a_python_repr(encoded):
    shard = encoded / "part-00001.h5"
    with h5py.File(shard, "r+") as f:
        begin, end = f["encoded_offsets"][1:3]
        f["encoded"][begin:end] = np.frombuffer(b"\x00junk" * (end - begin), np.uint8)[
            : end - begin
        ]
    reader = open_dataset(encoded).reader()
    with pytest.raises(BadSample) as err:
        reader.decode(5)
    reader.close()
    text = one_line(err)
    assert f"sample 5 in {shard} cannot be read: row 1 of 'encoded': " in text, text
    assert "not a readable image file (JPEG, PNG)" in text, text


def test_offsets_of_a_float_dtype_name_the_dtype(encoded):
    shard = encoded / "part-00002.h5"
    with h5py.File(shard, "r+") as f:
        offsets = f["encoded_offsets"][()]
        del f["encoded_offsets"]
        f["encoded_offsets"] = offsets.astype(np.float64)  # the right values
    with pytest.raises(DataError) as err:
        open_dataset(encoded)
    text = one_line(err)
    assert f"{shard}: field 'encoded_offsets' is float64[5]" in text, text
    assert "integer dtype" in text and "must rise" not in text, text


@pytest.mark.parametrize("kind", ["encoded", "pixels"])
@pytest.mark.parametrize("value", ["{oops", json.dumps(["a", "b", "z"]), json.dumps(["a", "b"])])
def test_a_later_shards_classes_must_be_the_first_shards(request, kind, value):
    shards = request.getfixturevalue(kind)
    with h5py.File(shards / "part-00002.h5", "r+") as f:
        f.attrs["classes"] = value
    with pytest.raises(DataError) as err:
        open_dataset(shards)
    text = one_line(err)
    assert f"{shards / 'part-00002.h5'}: attribute 'classes'" in text, text
    if value != "{oops":
        assert str(shards / "part-00000.h5") in text, text
    with h5py.File(shards / "part-00002.h5", "r+") as f:
        del f.attrs["classes"]  # a later shard without the attribute takes the first shard's
    assert open_dataset(shards).classes == ["a", "b", "c"]
