"""`open_dataset()`: which kind of data set a path holds (HDF5 shards or an image folder).

Apart from hpcdl.data.dataset, which the readers import: the readers import the contract,
this module imports the readers, and nothing imports back.
"""

from __future__ import annotations

from pathlib import Path

from hpcdl.data.dataset import DataError
from hpcdl.data.hdf5 import HDF5_SUFFIXES, HDF5Dataset
from hpcdl.data.imagefolder import FolderListing, ImageFolderDataset


def open_dataset(path: str | Path, index_in_data_root: bool = False):
    """Open an HDF5 file, a directory of HDF5 shards, or an image folder root/<class>/<file>
    (whose index is cached in the folder itself only with index_in_data_root)."""
    if kind_of(path) == "hdf5":
        return HDF5Dataset(path)
    return ImageFolderDataset(path, index_in_data_root)


def reopen_spec(ds) -> dict:
    """What another process (a loader worker) needs to open ds as this one did: reopen()."""
    spec = {"source": str(ds.source)}
    if ds.kind == "folder":
        spec.update(index_path=ds.index_path and str(ds.index_path), key=ds.index.meta["key"])
    return spec


def reopen(spec: dict):
    """The data set another process opened (reopen_spec). An image folder is read through the
    very index that process read, even where the folder has changed since (files added,
    removed): sample i is the same file in every process. DataError when that index is gone."""
    if "key" not in spec:
        return open_dataset(spec["source"])
    if spec["index_path"]:
        ds = ImageFolderDataset.from_index_file(
            spec["source"], Path(spec["index_path"]), spec["key"]
        )
        if ds is not None:
            return ds
    ds = open_dataset(spec["source"])
    if ds.index.meta["key"] != spec["key"]:
        raise DataError(
            f"{spec['source']}: the folder changed (files added, removed or renamed) after this "
            "run indexed it, and that index can no longer be read, so a loader worker would "
            "number the samples differently; leave the folder unchanged during a run, and start "
            "the run again"
        )
    return ds


def open_listing(path: str | Path):
    """What a stage-only run needs of a data set: its files, sizes and samples. For an image
    folder that is a FolderListing (no image is opened); an HDF5 set is opened as usual."""
    return HDF5Dataset(path) if kind_of(path) == "hdf5" else FolderListing(path)


def kind_of(path: str | Path) -> str:
    """ "hdf5" or "folder": what path holds; DataError when it is neither."""
    p = Path(path)
    if not p.exists():
        raise DataError(
            f"{p}: no such file or directory (expected an HDF5 file, a directory of HDF5 "
            "shards, or an image folder root/<class>/<file>)"
        )
    if p.is_file():
        return "hdf5"
    entries = list(p.iterdir())
    if any(e.is_file() and e.suffix.lower() in HDF5_SUFFIXES for e in entries):
        return "hdf5"
    if any(e.is_dir() and not e.name.startswith(".") for e in entries):
        subdirs = {e.name for e in entries if e.is_dir()}
        if {"train", "val"} <= subdirs and _has_shards(p / "train"):
            raise DataError(
                f"{p} holds train/ and val/ shard directories, not samples; "
                f"use --data {p / 'train'} --val-data {p / 'val'}"
            )
        return "folder"
    raise DataError(
        f"{p}: directory holds no HDF5 shards (*.h5, *.hdf5) and no class subdirectories"
    )


def _has_shards(d: Path) -> bool:
    return d.is_dir() and any(e.suffix.lower() in HDF5_SUFFIXES for e in d.iterdir())
