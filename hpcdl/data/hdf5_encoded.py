"""Encoded HDF5 shards: each image file's original bytes (JPEG, PNG), decoded at load.

Layout of one shard (`python -m hpcdl.data convert folder SRC OUT --encoded` writes it):

    encoded          (total bytes,) uint8, contiguous, uncompressed: the files one after another
    encoded_offsets  (N + 1,) int64: row i is encoded[offsets[i]:offsets[i + 1]]
    labels           (N,) int64
    heights, widths  (N,) int64: from each image's header at conversion (0: unreadable header)
    attrs            classes (JSON list of names), grey (every image of the shard greyscale)

No pixel is decoded or resized at conversion, so a shard takes the bytes of the files (about
half of ImageNet's pixels at 256 x 256) and sample i decodes to exactly the pixels of the
folder's file i: the reader hands the row's bytes to image_file.decode_image, the folder's own
decode, or whole to `--decode gpu`. A row is one pread at the dataset's file offset.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from hpcdl.data.dataset import DataError

ENCODED = "encoded"  # the flat byte dataset
OFFSETS = "encoded_offsets"
PER_ROW = ("labels", "heights", "widths")


def is_encoded(f: h5py.File) -> bool:
    """True when the open shard holds encoded image files rather than decoded pixels."""
    return ENCODED in f


@dataclass(frozen=True)
class EncodedShardInfo:
    """What the data set keeps of one encoded shard: (N,) int64 columns and two summaries."""

    labels: np.ndarray
    heights: np.ndarray
    widths: np.ndarray
    grey: bool  # every image of the shard is greyscale
    largest: int  # bytes of its largest file


def check_encoded_shard(shard: Path, f: h5py.File) -> EncodedShardInfo:
    """The per-row columns of an encoded shard, or a DataError naming the shard and field."""
    for field in (ENCODED, OFFSETS, *PER_ROW):
        if field not in f or not isinstance(f[field], h5py.Dataset):
            raise DataError(f"{shard}: no '{field}' dataset (found: {sorted(f.keys())})")
    data, offsets = f[ENCODED], f[OFFSETS][()]
    if data.dtype != np.uint8 or data.ndim != 1:
        raise DataError(
            f"{shard}: field '{ENCODED}' is {data.dtype}{list(data.shape)}; expected (bytes,) uint8"
        )
    n = len(offsets) - 1 if offsets.ndim == 1 else -1
    if n < 0 or offsets.dtype.kind not in "iu":
        raise DataError(
            f"{shard}: field '{OFFSETS}' is {offsets.dtype}{list(offsets.shape)}; expected "
            f"(N + 1,) of an integer dtype (int64, as convert writes it): convert it again"
        )
    if offsets[0] != 0 or offsets[-1] != data.shape[0] or np.any(np.diff(offsets) < 0):
        raise DataError(
            f"{shard}: field '{OFFSETS}' must rise from 0 to the {data.shape[0]} bytes of "
            f"'{ENCODED}'; the shard is damaged: convert it again"
        )
    columns = []
    for field in PER_ROW:
        col = f[field]
        if col.shape != (n,) or col.dtype.kind not in "iu":
            raise DataError(
                f"{shard}: field '{field}' is {col.dtype}{list(col.shape)}; expected ({n},) "
                f"integers, one per row of '{OFFSETS}'"
            )
        columns.append(col[()].astype(np.int64))
    largest = int(np.diff(offsets).max()) if n else 0
    return EncodedShardInfo(*columns, grey=bool(f.attrs.get("grey", False)), largest=largest)


class EncodedShard:
    """One open encoded shard: rows read with one pread each (through h5py when the bytes are
    not stored contiguously)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = h5py.File(path, "r")
        self.data = self.file[ENCODED]
        self.offsets = self.file[OFFSETS][()].astype(np.int64)  # (N + 1,)
        self.fd, self.base = -1, 0
        base = self.data.id.get_offset()
        if base is not None and self.data.compression is None and self.data.chunks is None:
            self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            self.base = base

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def row(self, i: int) -> bytes:
        """The file bytes of row i; OSError when the shard ends early (changed while read)."""
        begin, end = int(self.offsets[i]), int(self.offsets[i + 1])
        if self.fd < 0:
            return self.data[begin:end].tobytes()
        data = os.pread(self.fd, end - begin, self.base + begin)
        if len(data) != end - begin:
            raise OSError(
                f"the shard ends inside row {i} (it is {os.fstat(self.fd).st_size} bytes now): "
                "it was truncated or changed while being read; restore it and resume from the "
                "last checkpoint"
            )
        return data

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.file.close()
