"""Convert an image folder into a few big files that keep each image file's bytes.

    convert folder SRC OUT --encoded      OUT/train/part-00000.h5 ... (hpcdl.data.hdf5_encoded)
    convert folder SRC OUT --to tar       OUT/shard-000000.tar ... + OUT/classes.json

No image is decoded or resized: the shards hold the files' bytes in the folder's sample order
(its index's order), so a run on them draws the same samples, and decodes the same pixels, as a
run on the folder. Each file is opened once and its header parsed (height, width and greyscale,
which the loader needs before it decodes: the folder keeps them in its index).

Tar shards are WebDataset's layout: per sample the members KEY.<ext> (the file's bytes; its
extension, lower case) and KEY.cls (the label, an ASCII integer), KEY the sample number
zero-padded; classes.json beside them is the JSON list of class names in label order.

Atomic like every conversion: written into OUT/.hpcdl-convert-<pid>/, each file fsynced, then
moved into OUT; on any error nothing is left behind. OUT may not lie inside SRC, and for tar
shards may hold no other file that `--data OUT` would read (hpcdl.data.convert_output).
"""

from __future__ import annotations

import io
import json
import os
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from hpcdl.data.convert import split
from hpcdl.data.convert_output import converted_into
from hpcdl.data.dataset import DataError
from hpcdl.data.hdf5_encoded import ENCODED, OFFSETS
from hpcdl.data.image_file import image_header
from hpcdl.data.imagefolder import scan_folder
from hpcdl.fsync import fsync_path

CLASSES_NAME = "classes.json"  # the tar shards' class map (read by hpcdl.data.tarshards)
KEY_DIGITS = 9
_TAR_BLOCK = 512
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40})
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$")


@dataclass(frozen=True)
class ShardSize:
    """A shard's limit: `samples` per shard, or (samples 0) `bytes` of stored files per shard
    (a shard holds at least one sample, so a file larger than the limit gets its own)."""

    samples: int = 0
    bytes: int = 0

    def is_full(self, count: int, nbytes: int, next_bytes: int) -> bool:
        """True when a shard holding count samples of nbytes cannot take next_bytes more."""
        if count == 0:
            return False
        if self.samples:
            return count >= self.samples
        return nbytes + next_bytes > self.bytes

    def rows(self, row_bytes: int) -> int:
        """Samples per shard of rows of row_bytes each (decoded pixels)."""
        return self.samples or max(1, self.bytes // row_bytes)


def parse_shard_size(text: str) -> ShardSize:
    """'1000' (samples), '256MB', '1GiB', '500kB' (bytes: SI or binary units) -> ShardSize."""
    m = _SIZE.match(str(text).lower())
    unit = _UNITS.get(m.group(2)) if m else None
    value = float(m.group(1)) if m else 0.0
    if m and not m.group(2) and value.is_integer() and value >= 1:
        return ShardSize(samples=int(value))
    if unit is not None and m.group(2) and int(value * unit) >= 1:
        return ShardSize(bytes=int(value * unit))
    raise DataError(
        f"--shard-size: expected a number of samples (e.g. 1000) or of bytes (e.g. 256MB, "
        f"1GiB), >= 1, got {text!r}"
    )


@dataclass(frozen=True)
class FolderFiles:
    """An image folder's files in its sample order: relative paths, labels, class names."""

    root: Path
    relpaths: list[str]
    labels: np.ndarray  # (N,) int64
    classes: list[str]


def folder_files(src: str | Path, out: str | Path) -> FolderFiles:
    """The files of the image folder src; DataError when out lies inside it."""
    root = Path(src)
    relpaths, labels, classes = scan_folder(root)
    real_root, real_out = Path(os.path.realpath(root)), Path(os.path.realpath(out))
    if real_out.is_relative_to(real_root):
        raise DataError(
            f"{out} is inside the data set {src}; write the shards to a directory outside it "
            "(a conversion never writes into its source)"
        )
    return FolderFiles(root, relpaths, np.asarray(labels, np.int64), classes)


def read_file(path: Path) -> tuple[bytes, float]:
    """(bytes, mtime) of one file, or a DataError naming it."""
    try:
        with open(path, "rb") as f:
            return f.read(), os.fstat(f.fileno()).st_mtime
    except OSError as exc:
        raise DataError(f"{path}: cannot be read ({exc.strerror or exc})") from None


def write_encoded(
    folder: FolderFiles, out: str | Path, size: ShardSize, val_fraction: float, seed: int
) -> list[Path]:
    """OUT/train (and OUT/val with val_fraction > 0) of encoded HDF5 shards, atomically."""
    n = len(folder.relpaths)
    train, val = split(np.arange(n), folder.labels, val_fraction, seed)
    splits = {"train": train[0]} if val is None else {"train": train[0], "val": val[0]}
    with converted_into(Path(out), list(splits)) as tmp:
        for name, rows in splits.items():
            (tmp / name).mkdir()
            _write_encoded_split(folder, rows, tmp / name, size)
            fsync_path(tmp / name)
    return [Path(out) / name for name in splits]


def _write_encoded_split(folder: FolderFiles, rows: np.ndarray, into: Path, size: ShardSize):
    shard: list[bytes] = []
    shard_rows: list[int] = []
    number = 0
    for row in rows.tolist():
        data, _ = read_file(folder.root / folder.relpaths[row])
        if size.is_full(len(shard), sum(map(len, shard)), len(data)):
            _write_encoded_shard(into / f"part-{number:05d}.h5", shard, shard_rows, folder)
            shard, shard_rows, number = [], [], number + 1
        shard.append(data)
        shard_rows.append(row)
    _write_encoded_shard(into / f"part-{number:05d}.h5", shard, shard_rows, folder)


def _write_encoded_shard(path: Path, files: list[bytes], rows: list[int], folder: FolderFiles):
    headers = np.array([image_header(io.BytesIO(data)) for data in files], np.int64)  # (n, 3)
    offsets = np.zeros(len(files) + 1, np.int64)
    np.cumsum([len(data) for data in files], out=offsets[1:])
    with h5py.File(path, "w") as f:
        f.create_dataset(ENCODED, data=np.frombuffer(b"".join(files), np.uint8))  # contiguous
        f.create_dataset(OFFSETS, data=offsets)
        f.create_dataset("labels", data=folder.labels[rows])
        f.create_dataset("heights", data=headers[:, 0])
        f.create_dataset("widths", data=headers[:, 1])
        f.attrs["classes"] = json.dumps(folder.classes)
        readable = headers[:, 0] > 0
        f.attrs["grey"] = bool(np.all(headers[readable, 2])) if readable.any() else True
    fsync_path(path)


def write_tar(folder: FolderFiles, out: str | Path, size: ShardSize) -> list[Path]:
    """OUT/shard-000000.tar ... and OUT/classes.json (WebDataset layout), atomically."""
    out = Path(out)
    digits = max(KEY_DIGITS, len(str(len(folder.relpaths) - 1)))
    written: list[str] = []
    with converted_into(out, [CLASSES_NAME], holds_data_set=True) as tmp:
        tar, nbytes, count = None, 0, 0
        for key, rel in enumerate(folder.relpaths):
            data, mtime = read_file(folder.root / rel)
            label = str(int(folder.labels[key])).encode()
            member_bytes = _tar_bytes(len(data)) + _tar_bytes(len(label))
            if tar is None or size.is_full(count, nbytes, member_bytes):
                _close_tar(tar)
                written.append(f"shard-{len(written):06d}.tar")
                tar = tarfile.open(tmp / written[-1], "w", format=tarfile.USTAR_FORMAT)
                nbytes, count = 0, 0
            name = f"{key:0{digits}d}"
            _add_member(tar, f"{name}{Path(rel).suffix.lower()}", data, mtime)
            _add_member(tar, f"{name}.cls", label, mtime)
            nbytes, count = nbytes + member_bytes, count + 1
        _close_tar(tar)
        (tmp / CLASSES_NAME).write_text(json.dumps(folder.classes) + "\n")
        fsync_path(tmp / CLASSES_NAME)
    return [out / name for name in written]


def _tar_bytes(n: int) -> int:
    """Bytes a member of n bytes takes in a tar: its header block and its padded data."""
    return _TAR_BLOCK + -(-n // _TAR_BLOCK) * _TAR_BLOCK


def _add_member(tar: tarfile.TarFile, name: str, data: bytes, mtime: float) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), int(mtime), 0o444
    tar.addfile(info, io.BytesIO(data))


def _close_tar(tar: tarfile.TarFile | None) -> None:
    if tar is not None:
        tar.close()
        fsync_path(Path(tar.name))
