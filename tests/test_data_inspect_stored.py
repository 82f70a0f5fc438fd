"""inspect's 'stored as' line: the dtype's name, and for image bytes (tar members, image
files) that they are decoded on read."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import make_folder
from tarshards_helpers import make_shards

from hpcdl.data.__main__ import main
from hpcdl.data.convert import write_dataset


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def stored_as(path, capsys) -> str:
    assert main(["inspect", str(path)]) == 0
    (line,) = [s for s in capsys.readouterr().out.splitlines() if "stored as:" in s]
    return line.split("stored as:", 1)[1].strip()


def test_tar_shards_are_image_members_decoded_on_read_to_uint8(tmp_path, capsys):
    make_shards(tmp_path / "d", shards=2, per_shard=2)
    line = stored_as(tmp_path / "d", capsys)
    assert "JPEG" in line and "decoded on read" in line and "uint8 HWC" in line
    assert "<class" not in line


def test_an_image_folder_is_image_files_decoded_on_read(tmp_path, capsys):
    make_folder(tmp_path / "f", per_class=2)
    line = stored_as(tmp_path / "f", capsys)
    assert "image files" in line and "decoded on read" in line and "<class" not in line


def test_hdf5_pixels_say_the_dtypes_name(tmp_path, capsys):
    x = np.zeros((4, 8, 8, 3), np.uint8)
    (train,) = write_dataset(tmp_path / "h", {"train": (x, np.arange(4) % 2)}, ["a", "b"])
    assert stored_as(train, capsys) == "uint8 HWC (8, 8, 3)"
