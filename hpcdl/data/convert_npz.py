"""`convert npz`: a NumPy .npz of images and labels, checked whole before anything is written.

Fields: `images` + `labels`, or Keras's `x_train` + `y_train` (and `x_test` + `y_test`, the
validation split); `classes` optional. Every check names the .npz and its field, so a bad array
is one line and OUT is left as it was (the HDF5 reader would refuse the same shards after they
were written):
- images: uint8 (N, H, W, C) or (N, H, W), N > 0; a test split of the training split's image
  shape; channels-first (N, C, H, W) arrays are refused with the transpose that fixes them
  rather than read as images C pixels high.
- labels: N integers 0..C-1, C = len(classes) when given, else the largest label + 1. Floats
  are taken when every one is a whole number (pandas and Keras users store 0.0, 1.0, ...);
  0.5 is refused rather than truncated to 0. Strings are refused: names go into `classes`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hpcdl.data.dataset import DataError

_CHANNELS = (1, 3, 4)


def npz_arrays(src: str | Path):
    """.npz with images/labels (or x_train/y_train[, x_test/y_test]) -> splits, classes."""
    src = Path(src)
    try:
        z = np.load(src, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise DataError(f"{src}: unreadable .npz ({exc})") from None
    with z:
        keys = set(z.files)
        if {"images", "labels"} <= keys:
            fields = {"train": ("images", "labels")}
        elif {"x_train", "y_train"} <= keys:
            fields = {"train": ("x_train", "y_train")}
            if {"x_test", "y_test"} <= keys:
                fields["val"] = ("x_test", "y_test")
        else:
            raise DataError(
                f"{src}: needs arrays 'images' and 'labels' (or 'x_train', 'y_train'), "
                f"found {sorted(keys)}"
            )
        names = {f for pair in fields.values() for f in pair} | ({"classes"} & keys)
        arrays = {name: _field(src, z, name) for name in names}
    classes = None
    if "classes" in arrays:
        classes = [str(c) for c in arrays["classes"].reshape(-1)]
    splits = {}
    for split, (x_name, y_name) in fields.items():
        x = _images(src, x_name, arrays[x_name])
        y = _labels(src, y_name, arrays[y_name], len(x), x_name)
        splits[split] = (x, y)
    _same_shape(src, fields, splits)
    if classes is None:
        classes = [str(i) for i in range(int(splits["train"][1].max()) + 1)]
    for split, (_, y_name) in fields.items():
        _in_range(src, y_name, splits[split][1], classes, "classes" in arrays)
    return splits, classes


def _field(src: Path, z, name: str) -> np.ndarray:
    try:
        return z[name]
    except (OSError, ValueError) as exc:  # object arrays need pickle, which is never loaded
        raise DataError(f"{src}: field '{name}' cannot be read ({exc})") from None


def _images(src: Path, name: str, x: np.ndarray) -> np.ndarray:
    """x as (N, H, W, C) uint8, or a DataError naming the field."""
    if x.ndim == 3:
        x = x[..., None]
    if x.dtype != np.uint8 or x.ndim != 4:
        raise DataError(
            f"{src}: field '{name}' is {x.dtype}{list(x.shape)}; need uint8 (N, H, W[, C])"
        )
    if len(x) == 0 or 0 in x.shape:
        raise DataError(f"{src}: field '{name}' holds no samples (shape {list(x.shape)})")
    if x.shape[-1] not in _CHANNELS and x.shape[1] in _CHANNELS:
        raise DataError(
            f"{src}: field '{name}' is {list(x.shape)}, which looks like (N, C, H, W); images "
            f"must be (N, H, W, C): save {name}.transpose(0, 2, 3, 1) instead"
        )
    return x


def _labels(src: Path, name: str, y: np.ndarray, n: int, x_name: str) -> np.ndarray:
    """y as (N,) int64, or a DataError naming the field."""
    if y.dtype.kind in "USO":
        raise DataError(
            f"{src}: field '{name}' holds strings; labels must be integers 0..C-1 "
            "(put the class names in a 'classes' array, in label order)"
        )
    y = y.reshape(-1)
    if len(y) != n:
        raise DataError(f"{src}: field '{x_name}' has {n} images but '{name}' {len(y)} labels")
    if y.dtype.kind == "f":
        bad = np.flatnonzero(~np.isfinite(y) | (y != np.round(y)))
        if len(bad):
            raise DataError(
                f"{src}: field '{name}' holds {y[bad[0]]} at sample {bad[0]}; labels must be "
                "integers 0..C-1"
            )
    elif y.dtype.kind not in "iub":
        raise DataError(f"{src}: field '{name}' is {y.dtype}; labels must be integers 0..C-1")
    low = np.flatnonzero(y < 0)
    if len(low):
        raise DataError(
            f"{src}: field '{name}' holds {y[low[0]]} at sample {low[0]}; labels must be 0..C-1"
        )
    return y.astype(np.int64)


def _same_shape(src: Path, fields: dict, splits: dict) -> None:
    if "val" not in splits:
        return
    train, val = splits["train"][0].shape[1:], splits["val"][0].shape[1:]
    if train != val:
        raise DataError(
            f"{src}: field '{fields['val'][0]}' holds images of shape {val} (H, W, C) but "
            f"'{fields['train'][0]}' of {train}; both splits need one shape"
        )


def _in_range(src: Path, name: str, y: np.ndarray, classes: list[str], named: bool) -> None:
    high = np.flatnonzero(y >= len(classes))
    if len(high):
        names = f"field 'classes' names {len(classes)}" if named else f"{len(classes)} classes"
        raise DataError(
            f"{src}: field '{name}' holds {y[high[0]]} at sample {high[0]}, but {names}; "
            f"labels must be 0..{len(classes) - 1}"
        )
