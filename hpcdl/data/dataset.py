"""What every data set offers the loader and the stager, and `open_dataset()` to pick the kind.

A data set is a list of files under one root (the unit the stager copies) and a map from sample
index to file id. Samples are read through a `SampleReader` made inside the process that reads
(never shared across a fork): `ds.reader(locate)`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from hpcdl.data.pfs import PfsEmulation

Locate = Callable[[int], Path]

HDF5_SUFFIXES = (".h5", ".hdf5")


class DataError(ValueError):
    """Unusable input data; the message names the file (and field or sample) that is wrong."""


class BadSample(DataError):
    """One sample could not be read or decoded."""

    def __init__(self, path: Path | str, index: int, reason: str) -> None:
        super().__init__(f"sample {index} in {path} cannot be read: {reason}")
        self.path, self.index = str(path), index


class FileEntry(NamedTuple):
    relpath: str  # relative to the data set root, '/'-separated
    size: int  # bytes


class ReadCounts:
    """Samples read from a staged (local) copy vs the parallel file system, and bad ones."""

    def __init__(self) -> None:
        self.local = 0
        self.pfs = 0
        self.bad = 0


class SourceReader:
    """What every reader shares: where file i is now (staged copy or PFS), the PFS emulation
    (HPCDL_STAGE_EMULATE_PFS slows PFS reads only) and the read counts."""

    def __init__(self, ds: Any, locate: Locate | None) -> None:
        self.ds = ds
        self.pfs = default_locate(ds.root, ds.files)
        self.locate = locate or self.pfs
        self.emulation = PfsEmulation.from_env()
        self.counts = ReadCounts()


def default_locate(root: Path, files: list[FileEntry]) -> Locate:
    """The PFS path of each file: root / relpath."""

    def locate(file_id: int) -> Path:
        return root / files[file_id].relpath

    return locate


def open_dataset(path: str | Path):
    """Open an HDF5 file, a directory of HDF5 shards, or an image folder root/<class>/<file>."""
    from hpcdl.data.hdf5 import HDF5Dataset  # noqa: PLC0415
    from hpcdl.data.imagefolder import ImageFolderDataset  # noqa: PLC0415

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
        return ImageFolderDataset(p)
    raise DataError(
        f"{p}: directory holds no HDF5 shards (*.h5, *.hdf5) and no class subdirectories"
    )


def _has_shards(d: Path) -> bool:
    return d.is_dir() and any(e.suffix.lower() in HDF5_SUFFIXES for e in d.iterdir())


def file_ids_from_offsets(offsets: np.ndarray, indices, n: int) -> np.ndarray:
    """File id of each sample index, given each file's first sample index (sorted)."""
    idx = np.asarray(indices, dtype=np.int64)
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise IndexError(f"sample index out of range 0..{n - 1}")
    return np.searchsorted(offsets, idx, side="right").astype(np.int64) - 1
