"""An .npz (a zip archive) given as --data is not read as HDF5 in silence: the one line says how
to convert it (`python -m hpcdl.data convert npz FILE OUT`)."""

from __future__ import annotations

import numpy as np
import pytest

from hpcdl.data import open_dataset
from hpcdl.data.dataset import DataError


def test_an_npz_gets_the_convert_hint(tmp_path):
    np.savez(tmp_path / "ok.npz", images=np.zeros((4, 8, 8, 3), np.uint8), labels=np.arange(4))
    with pytest.raises(DataError) as info:
        open_dataset(tmp_path / "ok.npz")
    text = str(info.value)
    assert "not a readable HDF5 file" in text and "\n" not in text, text
    assert f"python -m hpcdl.data convert npz {tmp_path / 'ok.npz'} OUT" in text, text


def test_other_files_get_no_npz_hint(tmp_path):
    (tmp_path / "x.h5").write_bytes(b"not hdf5 at all")
    with pytest.raises(DataError, match="not a readable HDF5 file") as info:
        open_dataset(tmp_path / "x.h5")
    assert "convert npz" not in str(info.value)
