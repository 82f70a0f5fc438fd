"""HDF5 data sets: one file or a directory of shard files, each with `images` and `labels`.

`images` is (N, H, W, C) or (N, H, W) uint8, or (N, C, H, W) float32; `labels` is (N,) integer.
Optional attributes on the file root: `classes` (JSON list of names), `mean` and `std` (one value
per channel, in the units of the stored pixels). Without them uint8 pixels are scaled to 0..1
and float32 pixels are used as they are. Only the first shard's attributes are read, except that
a later shard's `classes`, when it has one, must be the same (hpcdl.data.hdf5_shards).

Shards of encoded image files (`encoded` bytes + `encoded_offsets`, hpcdl.data.hdf5_encoded)
are kind "hdf5-encoded": the batch builder decodes them as it decodes an image folder's files
(same decode, same crop boxes from the stored heights and widths, the folder's default mean and
std), and `--decode gpu` gets each row's bytes. All shards of a data set are of one kind.

Reads: an uncompressed contiguous `images` dataset is read with pread at its file offset, one
system call per run of consecutive indices (no h5py call per sample); anything else is read by
h5py in the same runs. Handles are opened lazily by the reading process. Not a memory map: a
shard truncated or rewritten while the job reads it would end the process with SIGBUS and a
native crash dump naming no file, where a short pread is a BadSample naming the file.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

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
from hpcdl.data.hdf5_encoded import ENCODED, EncodedShard, check_encoded_shard, is_encoded
from hpcdl.data.hdf5_shards import (
    check_pixel_shard,
    check_same_classes,
    classes_attr,
    open_shard,
)
from hpcdl.data.image_file import BadSampleAt, decode_image
from hpcdl.data.imagefolder import IMAGENET_MEAN, IMAGENET_STD
from hpcdl.data.pfs import open_latency, throttle

HDF5_SUFFIXES = (".h5", ".hdf5")


class HDF5Dataset:
    """HDF5 shards of decoded pixels (kind "hdf5") or of encoded image files (kind
    "hdf5-encoded", hpcdl.data.hdf5_encoded: decoded at load like an image folder's files)."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        self.source = path
        self.root, shards = _list_shards(path)
        self.encoded = _is_encoded(shards[0])
        self.kind = "hdf5-encoded" if self.encoded else "hdf5"
        self._read_metadata(shards[0])
        counts = self._open_encoded(shards) if self.encoded else self._open_pixels(shards)
        relpaths = [shard.relative_to(self.root).as_posix() for shard in shards]
        self.files = FileTable.from_entries(relpaths, [_size(s) for s in shards])  # the shards
        self.offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        if self.classes is None:
            k = int(self.labels.max()) + 1 if len(self.labels) else 0
            self.classes = [str(i) for i in range(k)]
        self.check_labels(len(self.classes))
        c = self.sample_shape[0]
        if self.mean is None and self.encoded:  # an image folder's statistics
            self.mean = np.array(IMAGENET_MEAN if c == 3 else [127.5], np.float32)
            self.std = np.array(IMAGENET_STD if c == 3 else [127.5], np.float32)
        elif self.mean is None:
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

    def _open_pixels(self, shards: list[Path]) -> list[int]:
        """Check shards of decoded pixels; set labels, dtype, stored_shape; samples per shard."""
        labels = []
        first_shape = None
        for shard in shards:
            with open_shard(shard) as f:
                shape, dtype, lab = check_pixel_shard(shard, f)
                check_same_classes(shard, f, shards[0], self.classes)
            if first_shape is None:
                first_shape, self.dtype = shape, dtype
            elif (shape, dtype) != (first_shape, self.dtype):
                raise DataError(
                    f"{shard}: images are {dtype}{list(shape)} per sample but {shards[0]} has "
                    f"{self.dtype}{list(first_shape)}; all shards must agree"
                )
            labels.append(lab)
        self.stored_shape = first_shape  # per sample, as stored: (H, W, C) or (C, H, W)
        self.layout = "CHW" if self.dtype == np.float32 else "HWC"
        self.labels = np.concatenate(labels).astype(np.int64)  # (N,)
        return [len(lab) for lab in labels]

    def _open_encoded(self, shards: list[Path]) -> list[int]:
        """Check encoded shards; set labels, heights, widths (N,) int64 as an image folder's
        index has them, the sample shape and the largest file's bytes; samples per shard."""
        infos = []
        for shard in shards:
            with open_shard(shard) as f:
                if not is_encoded(f) and "images" in f:
                    raise DataError(
                        f"{shard}: holds decoded 'images' but {shards[0]} holds encoded image "
                        "files; all shards must agree"
                    )
                infos.append(check_encoded_shard(shard, f))
                check_same_classes(shard, f, shards[0], self.classes)
        self.dtype, self.layout = np.uint8, "HWC"
        self.labels = np.concatenate([i.labels for i in infos])
        self.heights = np.concatenate([i.heights for i in infos])
        self.widths = np.concatenate([i.widths for i in infos])
        self.largest_sample_bytes = max(i.largest for i in infos)
        readable = self.heights > 0
        if not readable.any():
            raise DataError(f"{self.source}: none of the {len(self.labels)} images can be read")
        channels = 1 if all(i.grey for i in infos) else 3
        self._encoded_shape = (
            channels,
            int(self.heights[readable].min()),
            int(self.widths[readable].min()),
        )
        return [len(i.labels) for i in infos]

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
        self.classes = classes_attr(shard, attrs.get("classes"))
        self.named_classes = self.classes is not None  # else labels are bare class indices
        has_stats = "mean" in attrs and "std" in attrs
        self.mean = np.asarray(attrs["mean"], np.float32).reshape(-1) if has_stats else None
        self.std = np.asarray(attrs["std"], np.float32).reshape(-1) if has_stats else None

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def sample_shape(self) -> tuple[int, int, int]:
        """Model input (C, H, W): for encoded files (C, smallest height, smallest width)."""
        if self.encoded:
            return self._encoded_shape
        s = self.stored_shape
        return tuple(s) if self.layout == "CHW" else (s[2], s[0], s[1])

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def file_ids(self, indices) -> np.ndarray:
        return file_ids_from_offsets(self.offsets, indices, len(self))

    def reader(self, locate: Locate | None = None) -> HDF5Reader | EncodedHDF5Reader:
        return EncodedHDF5Reader(self, locate) if self.encoded else HDF5Reader(self, locate)


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


def _is_encoded(shard: Path) -> bool:
    with open_shard(shard) as f:
        return is_encoded(f)


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


class _ShardReader(SourceReader):
    """What both readers share: shards opened on first use by the process that reads, from the
    staged copy, else (missing or unusable copy) from the PFS."""

    def __init__(self, ds: HDF5Dataset, locate: Locate | None) -> None:
        super().__init__(ds, locate)
        self._shards: dict[int, Any] = {}

    def _open_shard(self, path: Path) -> Any:
        raise NotImplementedError

    def _shard(self, fid: int, first_index: int) -> Any:
        path = Path(self.locate(fid))
        shard = self._shards.get(fid)
        if shard is not None and shard.path == path:
            return shard
        if shard is not None:
            shard.close()
        pfs = self.pfs(fid)
        try:
            if path == pfs:
                open_latency(self.emulation)
            shard = self._open_shard(path)
        except (OSError, KeyError) as exc:
            if path == pfs:
                raise BadSample(path, first_index, str(exc)) from None
            try:  # the staged copy is unusable: read the PFS original
                open_latency(self.emulation)
                shard = self._open_shard(pfs)
            except (OSError, KeyError) as exc2:
                raise BadSample(pfs, first_index, str(exc2)) from None
        self._shards[fid] = shard
        return shard

    def close(self) -> None:
        for shard in self._shards.values():
            shard.close()
        self._shards.clear()


class HDF5Reader(_ShardReader):
    """Reads minibatches of decoded pixels in the process that owns it."""

    def _open_shard(self, path: Path) -> _Shard:
        return _Shard(path, self.ds)

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


class EncodedHDF5Reader(_ShardReader):
    """Decodes the encoded image files of shards in the process that owns it, with the image
    folder's decode (image_file.decode_image), or hands their bytes to `--decode gpu`
    (file_bytes.FileBytesReader reads _open)."""

    def __init__(self, ds: HDF5Dataset, locate: Locate | None) -> None:
        super().__init__(ds, locate)
        self.mode = "L" if ds.sample_shape[0] == 1 else "RGB"

    def _open_shard(self, path: Path) -> EncodedShard:
        return EncodedShard(path)

    def _row(self, index: int) -> tuple[bytes, BadSampleAt]:
        """(file bytes of sample index, where they lie), counted as local or PFS reads."""
        fid = int(self.ds.file_ids([index])[0])
        shard = self._shard(fid, index)
        row = index - int(self.ds.offsets[fid])
        where = BadSampleAt(shard.path, index, f"row {row} of '{ENCODED}': ")
        try:
            data = shard.row(row)
        except (OSError, ValueError) as exc:
            raise where.error(str(exc)) from None
        if shard.path == self.pfs(fid):
            throttle(len(data), self.emulation)
            self.counts.pfs += 1
        else:
            self.counts.local += 1
        return data, where

    def _open(self, index: int) -> tuple[io.BytesIO, Path]:
        """(the sample's file bytes as an open file, its shard): the image folder reader's API."""
        data, where = self._row(index)
        return io.BytesIO(data), where.path

    def decode(
        self,
        index: int,
        draft: tuple[int, int] | None = None,
        box: tuple[int, int, int, int] | None = None,
    ) -> tuple[np.ndarray, tuple[float, float]]:
        """(image (h, w, C) uint8, (h / indexed h, w / indexed w)): ImageFolderReader.decode."""
        data, where = self._row(index)
        indexed_hw = (int(self.ds.heights[index]), int(self.ds.widths[index]))
        return decode_image(io.BytesIO(data), self.mode, indexed_hw, draft, box, where)
