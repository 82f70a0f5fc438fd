"""`open_dataset()`: which kind of data set a path holds (HDF5 shards, tar shards or an image
folder).

Apart from hpcdl.data.dataset, which the readers import: the readers import the contract,
this module imports the readers, and nothing imports back.
"""

from __future__ import annotations

from pathlib import Path

from hpcdl.data.dataset import DataError
from hpcdl.data.hdf5 import HDF5_SUFFIXES, HDF5Dataset
from hpcdl.data.imagefolder import FolderIndex, FolderListing, ImageFolderDataset, save_index
from hpcdl.data.indexfile import parse_index
from hpcdl.data.tarindex import is_brace_pattern, is_compressed_name, unsupported_pattern
from hpcdl.data.tarshards import TarIndex, TarShardDataset, save_tar_index


def open_dataset(path: str | Path, index_in_data_root: bool = False):
    """Open an HDF5 file, a directory of HDF5 shards, tar shards (a directory of *.tar or a
    pattern shards-{000..099}.tar: hpcdl.data.tarshards) or an image folder root/<class>/<file>
    (whose index is cached in the folder itself only with index_in_data_root; a tar index never
    is)."""
    kind = kind_of(path)
    if kind == "hdf5":
        return HDF5Dataset(path)
    if kind == "tar":
        return TarShardDataset(path)
    return ImageFolderDataset(path, index_in_data_root)


def reopen_spec(ds) -> dict:
    """What another process (a loader worker) needs to open ds as this one did: reopen()."""
    spec = {"source": str(ds.source)}
    if ds.kind in ("folder", "tar"):
        spec.update(index_path=ds.index_path and str(ds.index_path), key=ds.index.meta["key"])
        spec.update(kind=ds.kind)
    return spec


def reopen(spec: dict):
    """The data set another process opened (reopen_spec). An image folder is read through the
    very index that process read, even where the folder has changed since (files added,
    removed): sample i is the same file in every process. DataError when that index is gone."""
    if "key" not in spec:
        return open_dataset(spec["source"])
    if spec["index_path"]:
        ds = from_index_file(spec["source"], Path(spec["index_path"]), spec["key"])
        if ds is not None:
            return ds
    if spec.get("kind") == "tar":
        ds = TarShardDataset(spec["source"])
    else:
        ds = open_dataset(spec["source"])
    if ds.index.meta["key"] != spec["key"]:
        raise DataError(
            f"{spec['source']}: the folder changed (files added, removed or renamed) after this "
            "run indexed it, and that index can no longer be read, so a loader worker would "
            "number the samples differently; leave the folder unchanged during a run, and start "
            "the run again"
        )
    return ds


def from_index_file(source: str | Path, path: Path, key: str):
    """The image folder or tar shards at source whose index another process cached at path;
    None when it cannot be mapped here or no longer holds key."""
    ds = TarShardDataset.from_index_file(source, path, key)  # None for a folder's index
    return ds if ds is not None else ImageFolderDataset.from_index_file(source, path, key)


def save_shared_index(source: str | Path, data: bytes, in_data_root: bool) -> Path | None:
    """Rank 0's index (its file's bytes) written to this node's cache: where it went, or None
    (hpcdl.startup.share_index)."""
    columns, meta = parse_index(data)
    if meta.get("kind") == "tar":
        return save_tar_index(Path(source), TarIndex(columns, meta)).path
    return save_index(Path(source), FolderIndex(columns, meta), in_data_root).path


def dataset_of_index(source: str | Path, data: bytes, path: Path | None, key: str):
    """The data set at source read through rank 0's index: mapped from path where this process
    can, else held from its bytes (hpcdl.startup.share_index)."""
    ds = None if path is None else from_index_file(source, path, key)
    if ds is not None:
        return ds
    columns, meta = parse_index(data)
    if meta.get("kind") == "tar":
        return TarShardDataset(source, index=TarIndex(columns, meta))
    return ImageFolderDataset(source, index=FolderIndex(columns, meta))


def open_listing(path: str | Path):
    """What a stage-only run needs of a data set: its files, sizes and samples. For an image
    folder that is a FolderListing (no image is opened); HDF5 and tar shards are opened as
    usual (a tar index comes from the cache when a run has built it)."""
    kind = kind_of(path)
    if kind == "folder":
        return FolderListing(path)
    return HDF5Dataset(path) if kind == "hdf5" else TarShardDataset(path)


def kind_of(path: str | Path) -> str:
    """ "hdf5", "tar" or "folder": what path holds; DataError when it is none of them."""
    p = Path(path)
    if is_brace_pattern(p):
        return "tar"
    if not p.exists():
        pattern = unsupported_pattern(path)
        if pattern is not None:
            raise pattern
        raise DataError(
            f"{p}: no such file or directory (expected an HDF5 file, a directory of HDF5 "
            "or tar shards, or an image folder root/<class>/<file>)"
        )
    if p.is_file():
        return "tar" if _is_tar_name(p.name) else "hdf5"
    entries = sorted(p.iterdir())
    hdf5 = [e for e in entries if e.is_file() and e.suffix.lower() in HDF5_SUFFIXES]
    tar = [e for e in entries if e.is_file() and _is_tar_name(e.name)]
    if hdf5 and tar:  # as compressed shards beside plain ones: one kind left out unsaid
        raise DataError(
            f"{p} holds both HDF5 shards ({hdf5[0].name}, ...) and tar shards ({tar[0].name}, "
            "...); a data set is one kind: move one kind into a directory of its own"
        )
    if hdf5:
        return "hdf5"
    if tar:
        return "tar"
    if any(e.is_dir() and not e.name.startswith(".") for e in entries):
        subdirs = {e.name for e in entries if e.is_dir()}
        if {"train", "val"} <= subdirs and _has_shards(p / "train"):
            raise DataError(
                f"{p} holds train/ and val/ shard directories, not samples; "
                f"use --data {p / 'train'} --val-data {p / 'val'}"
            )
        return "folder"
    raise DataError(
        f"{p}: directory holds no HDF5 shards (*.h5, *.hdf5), no tar shards (*.tar) and no "
        "class subdirectories"
    )


def _is_tar_name(name: str) -> bool:
    return name.lower().endswith(".tar") or is_compressed_name(name)


def _has_shards(d: Path) -> bool:
    return d.is_dir() and any(e.suffix.lower() in HDF5_SUFFIXES for e in d.iterdir())
