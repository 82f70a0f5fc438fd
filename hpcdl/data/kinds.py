"""`open_dataset()`: which kind of data set a path holds (HDF5 shards or an image folder).

Apart from hpcdl.data.dataset, which the readers import: the readers import the contract,
this module imports the readers, and nothing imports back.
"""

from __future__ import annotations

from pathlib import Path

from hpcdl.data.dataset import DataError
from hpcdl.data.hdf5 import HDF5_SUFFIXES, HDF5Dataset
from hpcdl.data.imagefolder import ImageFolderDataset


def open_dataset(path: str | Path, index_in_data_root: bool = False):
    """Open an HDF5 file, a directory of HDF5 shards, or an image folder root/<class>/<file>
    (whose index is cached in the folder itself only with index_in_data_root)."""
    p = Path(path)
    if not p.exists():
        raise DataError(
            f"{p}: no such file or directory (expected an HDF5 file, a directory of HDF5 "
            "shards, or an image folder root/<class>/<file>)"
        )
    if p.is_file():
        return HDF5Dataset(p)
    entries = list(p.iterdir())
    if any(e.is_file() and e.suffix.lower() in HDF5_SUFFIXES for e in entries):
        return HDF5Dataset(p)
    if any(e.is_dir() and not e.name.startswith(".") for e in entries):
        subdirs = {e.name for e in entries if e.is_dir()}
        if {"train", "val"} <= subdirs and _has_shards(p / "train"):
            raise DataError(
                f"{p} holds train/ and val/ shard directories, not samples; "
                f"use --data {p / 'train'} --val-data {p / 'val'}"
            )
        return ImageFolderDataset(p, index_in_data_root)
    raise DataError(
        f"{p}: directory holds no HDF5 shards (*.h5, *.hdf5) and no class subdirectories"
    )


def _has_shards(d: Path) -> bool:
    return d.is_dir() and any(e.suffix.lower() in HDF5_SUFFIXES for e in d.iterdir())
