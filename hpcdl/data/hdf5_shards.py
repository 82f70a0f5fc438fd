"""One HDF5 shard's checks: opening it, a shard of decoded pixels' fields, and the `classes`
attribute that every shard of a data set shares (hpcdl.data.hdf5; the fields of a shard of
encoded image files: hpcdl.data.hdf5_encoded).

`classes` is read from the first shard. A later shard may leave it out; when it has one, it must
be valid JSON and the same list, else labels would name different classes in different shards.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from hpcdl.data.dataset import DataError
from hpcdl.data.hdf5_encoded import is_encoded


def open_shard(shard: Path) -> h5py.File:
    """The shard open for reading, or a DataError naming it."""
    try:
        return h5py.File(shard, "r")
    except OSError as exc:
        raise DataError(f"{shard}: not a readable HDF5 file ({exc}){_npz_hint(shard)}") from None


def _npz_hint(path: Path) -> str:
    """How to convert path when it is a zip archive (NumPy's .npz), else ''."""
    try:
        with open(path, "rb") as f:
            is_zip = f.read(4) == b"PK\x03\x04"
    except OSError:
        return ""
    if not is_zip:
        return ""
    return (
        "; it is a zip archive (NumPy's .npz): convert it with "
        f"python -m hpcdl.data convert npz {path} OUT, then use --data OUT/train"
    )


def check_pixel_shard(shard: Path, f: h5py.File) -> tuple[tuple[int, ...], np.dtype, np.ndarray]:
    """(per-sample shape as stored, dtype, labels) of one open shard of decoded pixels, or a
    DataError naming it."""
    if is_encoded(f):
        raise DataError(
            f"{shard}: holds encoded image files but the first shard holds decoded "
            "'images'; all shards must agree"
        )
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
            f"{shard}: field 'labels' is {labels.dtype}{list(labels.shape)}; expected (N,) integers"
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


def classes_attr(shard: Path, value: Any) -> list[str] | None:
    """The class names of a shard's `classes` attribute (None without one), or a DataError."""
    if value is None:
        return None
    try:
        if isinstance(value, bytes):
            value = value.decode()
        return [str(c) for c in json.loads(value)]
    except (ValueError, TypeError) as exc:
        raise DataError(f"{shard}: attribute 'classes' is not a JSON list: {exc}") from None


def check_same_classes(shard: Path, f: h5py.File, first: Path, classes: list[str] | None) -> None:
    """DataError when the open shard has a `classes` attribute that is not first's classes."""
    if shard == first or "classes" not in f.attrs:
        return
    mine = classes_attr(shard, f.attrs["classes"])
    if mine == classes:
        return
    if classes is None:
        differs = f"names {len(mine)} classes but {first} has no 'classes' attribute"
    elif len(mine) != len(classes):
        differs = f"names {len(mine)} classes but {first}'s names {len(classes)}"
    else:
        k = next(i for i, (a, b) in enumerate(zip(mine, classes)) if a != b)
        differs = f"names label {k} {mine[k]!r} but {first}'s names it {classes[k]!r}"
    raise DataError(
        f"{shard}: attribute 'classes' {differs}; the shards of a data set share the first "
        "shard's classes: fix the attribute or convert the data again"
    )
