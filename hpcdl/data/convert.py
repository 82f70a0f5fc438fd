"""Convert data sets into HDF5 shards: scikit-learn digits, image folders, CIFAR pickles, .npz
(hpcdl.data.convert_npz).

Output: OUT/train/part-00000.h5 ... and OUT/val/... (when there is validation data), each shard
with `images` (N, H, W, C) uint8 (contiguous, uncompressed: the loader memory-maps it), `labels`
(N,) int64 and root attributes `classes` (JSON), `mean`, `std` (per channel, pixel units, from
the training split). Atomic: everything is written into OUT/.hpcdl-convert-<pid>/, each file
fsynced, then the split directories are renamed into place; on any error nothing is left behind
(hpcdl.data.convert_output, which also says what OUT may already hold).
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import h5py
import numpy as np

from hpcdl.data.convert_output import converted_into
from hpcdl.data.dataset import DataError
from hpcdl.data.image_file import ImageTooLarge, open_image, to_mode
from hpcdl.fsync import fsync_path

DEFAULT_SHARD_SIZE = 10000
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")


def digits_arrays() -> tuple[np.ndarray, np.ndarray, list[str]]:
    """scikit-learn's 1797 8x8 digits as (N, 8, 8, 1) uint8 (0..16 scaled to 0..255)."""
    from sklearn.datasets import load_digits  # noqa: PLC0415

    d = load_digits()
    images = np.round(d.images * (255.0 / 16.0)).astype(np.uint8)[..., None]
    return images, d.target.astype(np.int64), [str(i) for i in range(10)]


def split(images, labels, val_fraction: float, seed: int):
    """Seeded random split -> ((train_x, train_y), (val_x, val_y) or None)."""
    if not 0 <= val_fraction < 1:
        raise DataError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    n = len(labels)
    n_val = int(round(n * val_fraction))
    if n_val == n or (val_fraction and not n_val):
        left = "no training sample" if n_val else "no validation sample"
        raise DataError(
            f"--val-fraction {val_fraction} leaves {left} of the {n}; give a fraction that "
            f"holds out between 1 and {n - 1} samples, or 0 for no validation split"
        )
    perm = np.random.default_rng(seed).permutation(n)
    val, train = np.sort(perm[:n_val]), np.sort(perm[n_val:])
    val_part = (images[val], labels[val]) if n_val else None
    return (images[train], labels[train]), val_part


def channel_stats(images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and std of (N, H, W, C) uint8 pixels, float32 (C,)."""
    flat = images.reshape(-1, images.shape[-1]).astype(np.float64)
    std = flat.std(axis=0)
    return flat.mean(axis=0).astype(np.float32), np.where(std > 0, std, 1.0).astype(np.float32)


def write_dataset(
    out: str | Path,
    splits: dict[str, tuple[np.ndarray, np.ndarray]],
    classes: list[str],
    shard_size: int = DEFAULT_SHARD_SIZE,
) -> list[Path]:
    """Write {'train': (x, y), 'val': (x, y)} as shard directories under out, atomically."""
    if shard_size < 1:
        raise DataError(f"--shard-size must be >= 1, got {shard_size}")
    out = Path(out)
    for name, (x, y) in splits.items():
        if x.dtype != np.uint8 or x.ndim != 4 or len(x) != len(y) or len(y) == 0:
            raise DataError(f"{name} split: need (N, H, W, C) uint8 images and N labels, N > 0")
    mean, std = channel_stats(splits["train"][0])
    with converted_into(out, list(splits)) as tmp:
        for name, (x, y) in splits.items():
            (tmp / name).mkdir()
            for k, start in enumerate(range(0, len(y), shard_size)):
                path = tmp / name / f"part-{k:05d}.h5"
                _write_shard(
                    path,
                    x[start : start + shard_size],
                    y[start : start + shard_size],
                    classes,
                    mean,
                    std,
                )
            fsync_path(tmp / name)
    return [out / name for name in splits]


def _write_shard(path: Path, x, y, classes, mean, std) -> None:
    with h5py.File(path, "w") as f:
        f.create_dataset("images", data=np.ascontiguousarray(x))  # contiguous: memory-mappable
        f.create_dataset("labels", data=np.asarray(y, np.int64))
        f.attrs["classes"] = json.dumps(classes)
        f.attrs["mean"] = mean
        f.attrs["std"] = std
    fsync_path(path)


def folder_arrays(root: Path, relpaths: list[str], resize: int | None = None) -> np.ndarray:
    """The image files root/relpaths (an image folder's, convert_files.folder_files) as
    (N, H, W, C) uint8. Mixed sizes need resize=S (every image resized to S x S)."""
    from PIL import Image  # noqa: PLC0415

    images, first = [], None
    for rel in relpaths:
        path = root / rel
        try:
            with open_image(path) as im:
                im = to_mode(im, "RGB")
                if resize:
                    im = im.resize((resize, resize), Image.BILINEAR)
                arr = np.asarray(im)
        except ImageTooLarge as exc:
            raise DataError(f"{path}: {exc}, or remove it from the folder") from None
        except (OSError, SyntaxError, ValueError) as exc:
            raise DataError(f"{path}: unreadable image ({exc})") from None
        if first is None:
            first = (arr.shape, path)
        elif arr.shape != first[0]:
            raise DataError(
                f"{path} is {arr.shape[1]}x{arr.shape[0]} but {first[1]} is "
                f"{first[0][1]}x{first[0][0]}; pass --resize S to make every image S x S"
            )
        images.append(arr)
    return np.stack(images)


def cifar_arrays(src: str | Path):
    """CIFAR-10/100 python pickle batches -> {'train': (x, y), 'val': (x, y)}, classes."""
    src = Path(src)
    if (src / "data_batch_1").exists():
        train_files = sorted(src.glob("data_batch_*"))
        val_files, meta, key = [src / "test_batch"], src / "batches.meta", "labels"
        names_key = "label_names"
    elif (src / "train").exists():
        train_files, val_files, meta = [src / "train"], [src / "test"], src / "meta"
        key, names_key = "fine_labels", "fine_label_names"
    else:
        raise DataError(
            f"{src}: no CIFAR python batches (data_batch_1..5 + test_batch for CIFAR-10, "
            "train + test for CIFAR-100)"
        )

    def load(files):
        xs, ys = [], []
        for f in files:
            d = _unpickle(f)
            try:
                data, labels = d[b"data"], d[key.encode()]
            except KeyError as exc:
                raise DataError(f"{f}: no field {exc} in this CIFAR batch") from None
            xs.append(_cifar_images(f, data))
            ys.append(np.asarray(labels, np.int64).reshape(-1))
            if len(ys[-1]) != len(xs[-1]):
                raise DataError(
                    f"{f}: {len(xs[-1])} images but {len(ys[-1])} labels; not a CIFAR batch, "
                    "or a truncated one"
                )
        return np.concatenate(xs), np.concatenate(ys)

    names = [n.decode() for n in _unpickle(meta)[names_key.encode()]] if meta.exists() else None
    splits = {"train": load(train_files)}
    if all(f.exists() for f in val_files):
        splits["val"] = load(val_files)
    classes = names or [str(i) for i in range(int(splits["train"][1].max()) + 1)]
    return splits, classes


def _cifar_images(path: Path, data) -> np.ndarray:
    """A batch's 'data' (N, 3072) as (N, 32, 32, 3) uint8, or a DataError naming the file."""
    pixels = np.asarray(data, np.uint8)
    row = 3 * 32 * 32
    if pixels.size == 0 or pixels.size % row or (pixels.ndim == 2 and pixels.shape[1] != row):
        raise DataError(
            f"{path}: not a CIFAR batch, or a truncated one: 'data' holds {pixels.size} bytes "
            f"in rows of {pixels.shape[-1] if pixels.ndim else 0}, not rows of {row} "
            "(3 x 32 x 32); download the batches again"
        )
    return pixels.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)


def _unpickle(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            found = pickle.load(f, encoding="bytes")
    except (OSError, pickle.UnpicklingError, EOFError, ValueError) as exc:
        raise DataError(f"{path}: unreadable CIFAR batch ({exc})") from None
    if not isinstance(found, dict):
        raise DataError(f"{path}: not a CIFAR batch (a pickled {type(found).__name__}, not a dict)")
    return found
