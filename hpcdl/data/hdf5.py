"""HDF5 data sets: one file or a directory of shard files, each with `images` and `labels`.

`images` is (N, H, W, C) or (N, H, W) uint8, or (N, C, H, W) float32; `labels` is (N,) integer.
Optional attributes on the file root: `classes` (JSON list of names), `mean` and `std` (one value
per channel, in the units of the stored pixels). Without them uint8 pixels are scaled to 0..1
and float32 pixels are used as they are. Only the first shard's attributes are read.

Reads: an uncompressed contiguous `images` dataset is read with pread at its file offset, one
system call per run of consecutive indices (no h5py call per sample); anything else is read by
h5py in the same runs. Handles are opened lazily by the reading process. Not a memory map: a
shard truncated or rewritten while the job reads it would end the process with SIGBUS and a
native crash dump naming no file, where a short pread is a BadSample naming the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import h5py
import numpy as np

from hpcdl.data.dataset import (
    BadSample,
    DataError,
    FileTable,
    Locate,
    SourceReader,
    check_entries,
    check_link_inside,
    file_ids_from_offsets,
)
from hpcdl.data.pfs import open_latency, throttle

HDF5_SUFFIXES = (".h5", ".hdf5")


class HDF5Dataset:
    kind = "hdf5"

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        self.source = path
        self.root, shards = _list_shards(path)
        relpaths, sizes, labels, counts = [], [], [], []
        first_shape = None
        for shard in shards:
            shape, dtype, lab = _check_shard(shard)
            if first_shape is None:
                first_shape, self.dtype = shape, dtype
                self._read_metadata(shard)
            elif (shape, dtype) != (first_shape, self.dtype):
                raise DataError(
                    f"{shard}: images are {dtype}{list(shape)} per sample but {shards[0]} has "
                    f"{self.dtype}{list(first_shape)}; all shards must agree"
                )
            relpaths.append(shard.relative_to(self.root).as_posix())
            sizes.append(_size(shard))
            labels.append(lab)
            counts.append(len(lab))
        self.files = FileTable.from_entries(relpaths, sizes)  # the shards: the image folders' API
        self.stored_shape = first_shape  # per sample, as stored: (H, W, C) or (C, H, W)
        self.layout = "CHW" if self.dtype == np.float32 else "HWC"
        self.labels = np.concatenate(labels).astype(np.int64)  # (N,)
        self.offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        if self.classes is None:
            k = int(self.labels.max()) + 1 if len(self.labels) else 0
            self.classes = [str(i) for i in range(k)]
        self.check_labels(len(self.classes))
        c = self.sample_shape[0]
        if self.mean is None:
            self.mean = np.zeros(c, np.float32)
            self.std = np.full(c, 255.0 if self.dtype == np.uint8 else 1.0, np.float32)
        for name in ("mean", "std"):
            value = getattr(self, name)
            if value.shape != (c,) or (name == "std" and np.any(value <= 0)):
                raise DataError(
                    f"{shards[0]}: attribute '{name}' must hold {c} value(s)"
                    + (" > 0" if name == "std" else "")
                    + f", got {value.tolist()}"
                )

    def check_labels(self, num_classes: int, whose: str = "") -> None:
        """DataError naming the file and sample of the first label outside 0..num_classes-1."""
        bad = np.nonzero((self.labels < 0) | (self.labels >= num_classes))[0]
        if bad.size:
            fid = int(self.file_ids(bad[:1])[0])
            raise DataError(
                f"{self.root / self.files[fid].relpath}: field 'labels' holds "
                f"{self.labels[bad[0]]} at sample {bad[0] - self.offsets[fid]}, outside "
                f"0..{num_classes - 1} ({num_classes} classes{' ' + whose if whose else ''})"
            )

    def _read_metadata(self, shard: Path) -> None:
        with h5py.File(shard, "r") as f:
            attrs = dict(f.attrs)
        classes = attrs.get("classes")
        try:
            if isinstance(classes, bytes):
                classes = classes.decode()
            self.classes = [str(c) for c in json.loads(classes)] if classes is not None else None
        except (ValueError, TypeError) as exc:
            raise DataError(f"{shard}: attribute 'classes' is not a JSON list: {exc}") from None
        self.named_classes = self.classes is not None  # else labels are bare class indices
        has_stats = "mean" in attrs and "std" in attrs
        self.mean = np.asarray(attrs["mean"], np.float32).reshape(-1) if has_stats else None
        self.std = np.asarray(attrs["std"], np.float32).reshape(-1) if has_stats else None

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def sample_shape(self) -> tuple[int, int, int]:
        """Model input (C, H, W)."""
        s = self.stored_shape
        return tuple(s) if self.layout == "CHW" else (s[2], s[0], s[1])

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def file_ids(self, indices) -> np.ndarray:
        return file_ids_from_offsets(self.offsets, indices, len(self))

    def reader(self, locate: Locate | None = None) -> HDF5Reader:
        return HDF5Reader(self, locate)


def _list_shards(path: Path) -> tuple[Path, list[Path]]:
    """(root, shard files) of one HDF5 file or of a directory of shards (name order).

    A shard in a directory may be a symbolic link only to a file inside that directory tree."""
    if not path.is_dir():
        check_entries(path.parent, [path.name])
        return path.parent, [path]
    shards = sorted(p for p in path.iterdir() if p.suffix.lower() in HDF5_SUFFIXES)
    if not shards:
        raise DataError(f"{path}: no HDF5 shard files (*.h5, *.hdf5) in this directory")
    check_entries(path, [p.name for p in shards])
    real_root = Path(os.path.realpath(path))
    for shard in shards:
        if shard.is_symlink():
            check_link_inside(path, shard.name, real_root)
    return path, shards


def _size(p: Path) -> int:
    return p.stat().st_size


def _check_shard(shard: Path) -> tuple[tuple[int, ...], np.dtype, np.ndarray]:
    """(per-sample shape as stored, dtype, labels) of one shard, or a DataError naming it."""
    try:
        f = h5py.File(shard, "r")
    except OSError as exc:
        raise DataError(f"{shard}: not a readable HDF5 file ({exc})") from None
    with f:
        for field in ("images", "labels"):
            if field not in f or not isinstance(f[field], h5py.Dataset):
                raise DataError(f"{shard}: no '{field}' dataset (found: {sorted(f.keys())})")
        images, labels = f["images"], f["labels"]
        ok = (images.dtype == np.uint8 and images.ndim in (3, 4)) or (
            images.dtype == np.float32 and images.ndim == 4
        )
        if not ok:
            raise DataError(
                f"{shard}: field 'images' is {images.dtype}{list(images.shape)}; expected "
                "(N, H, W, C) or (N, H, W) uint8, or (N, C, H, W) float32"
            )
        if labels.ndim != 1 or labels.dtype.kind not in "iu":
            raise DataError(
                f"{shard}: field 'labels' is {labels.dtype}{list(labels.shape)}; expected (N,) "
                "integers"
            )
        if labels.shape[0] != images.shape[0]:
            raise DataError(
                f"{shard}: field 'labels' has {labels.shape[0]} entries but 'images' has "
                f"{images.shape[0]} samples"
            )
        shape = tuple(images.shape[1:])
        if images.ndim == 3:
            shape = shape + (1,)
        return shape, images.dtype, labels[()]


class _Shard:
    """One open shard: `images` read with pread when stored contiguously, else through h5py."""

    def __init__(self, path: Path, ds: HDF5Dataset) -> None:
        self.path = path
        self.stored_shape, self.dtype = ds.stored_shape, ds.dtype
        self.row_bytes = int(np.prod(ds.stored_shape)) * np.dtype(ds.dtype).itemsize
        self.file = h5py.File(path, "r")
        self.images = self.file["images"]
        self.fd, self.offset, self.end = -1, 0, 0
        offset = self.images.id.get_offset()
        if offset is not None and self.images.compression is None and self.images.chunks is None:
            self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            self.offset = offset
            self.end = offset + self.images.shape[0] * self.row_bytes

    def take(self, local: np.ndarray) -> np.ndarray:
        """Samples at local indices (any order): (b, *stored_shape), one read per run of
        consecutive indices."""
        order = np.argsort(local, kind="stable")
        srt = local[order]
        rows = np.empty((len(local), *self.stored_shape), self.dtype)  # in file order
        breaks = (np.nonzero(np.diff(srt) != 1)[0] + 1).tolist()
        for i, j in zip([0, *breaks], [*breaks, len(srt)]):
            self._read_into(rows[i:j], int(srt[i]))
        out = np.empty_like(rows)
        out[order] = rows
        return out

    def _read_into(self, dest: np.ndarray, first: int) -> None:
        """dest (n, *stored_shape) <- samples first..first+n-1; OSError if the file ends early."""
        if self.fd < 0:
            dest[...] = self.images[first : first + len(dest)].reshape(dest.shape)
            return
        buf = memoryview(dest).cast("B")
        start, done = self.offset + first * self.row_bytes, 0
        while done < len(buf):
            n = os.preadv(self.fd, [buf[done:]], start + done)
            if n == 0:  # end of file inside the dataset: the file shrank since it was opened
                raise OSError(
                    f"the file is {os.fstat(self.fd).st_size} bytes now but its 'images' end at "
                    f"byte {self.end}: it was truncated or changed while being read; restore it "
                    "and resume from the last checkpoint"
                )
            done += n

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.file.close()


class HDF5Reader(SourceReader):
    """Reads minibatches in the process that owns it; file handles opened on first use."""

    def __init__(self, ds: HDF5Dataset, locate: Locate | None) -> None:
        super().__init__(ds, locate)
        self._open: dict[int, _Shard] = {}

    def _shard(self, fid: int, first_index: int) -> _Shard:
        path = Path(self.locate(fid))
        shard = self._open.get(fid)
        if shard is not None and shard.path == path:
            return shard
        if shard is not None:
            shard.close()
        pfs = self.pfs(fid)
        try:
            if path == pfs:
                open_latency(self.emulation)
            shard = _Shard(path, self.ds)
        except (OSError, KeyError) as exc:
            if path == pfs:
                raise BadSample(path, first_index, str(exc)) from None
            try:  # the staged copy is unusable: read the PFS original
                open_latency(self.emulation)
                shard = _Shard(pfs, self.ds)
            except (OSError, KeyError) as exc2:
                raise BadSample(pfs, first_index, str(exc2)) from None
        self._open[fid] = shard
        return shard

    def read(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(images (B, *stored_shape) stored dtype, labels (B,) int64) for sample indices."""
        ds = self.ds
        indices = np.asarray(indices, np.int64)
        fids = ds.file_ids(indices)
        out = np.empty((len(indices), *ds.stored_shape), ds.dtype)
        for fid in np.unique(fids):
            sel = np.nonzero(fids == fid)[0]
            shard = self._shard(int(fid), int(indices[sel[0]]))
            local = indices[sel] - ds.offsets[fid]
            try:
                out[sel] = shard.take(local)
            except (OSError, ValueError) as exc:
                raise BadSample(shard.path, int(indices[sel[0]]), str(exc)) from None
            if shard.path == self.pfs(int(fid)):
                throttle(out[sel].nbytes, self.emulation)
                self.counts.pfs += len(sel)
            else:
                self.counts.local += len(sel)
        return out, ds.labels[indices]

    def close(self) -> None:
        for shard in self._open.values():
            shard.close()
        self._open.clear()
