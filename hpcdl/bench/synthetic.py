"""Synthetic images for the benchmarks and harnesses: one helper, so that one data set is made
one way wherever it is made.

Pixels come from a maker, (label, side) -> (side, side, 3) uint8, built from a seeded
numpy Generator that it owns and draws from in order; the same seed gives the same files:
- class_colours: noise (std 40) around one mean colour per class, so a model can learn the
  labels (`bench train`, the PyTorch peers);
- smooth_noise: a random sine pattern plus noise (std 30), which JPEG compresses like a photo
  (`bench loader`);
- noise: uniform random pixels, the worst case for a codec (`tools.bench validate`).
The writers: image_folder (root/<class>/<name>.<fmt>, what ImageFolderDataset reads),
hdf5_dataset (hpcdl.data.convert's layout), and encode/save for the harnesses whose trees have
their own shape (finetune's gratings, memory's hard links, staging's files of an exact size).
PIL is imported only when an image is written.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path

import numpy as np

PixelMaker = Callable[[int, int], np.ndarray]  # (label, side) -> (side, side, 3) uint8


def class_colours(rng: np.random.Generator, classes: int) -> PixelMaker:
    """Noise (std 40) around a mean colour per class, drawn first from rng."""
    colours = rng.integers(40, 216, (classes, 3))

    def make(label: int, side: int) -> np.ndarray:
        pixels = colours[label] + rng.normal(0, 40, (side, side, 3))
        return np.clip(pixels, 0, 255).astype(np.uint8)

    return make


def smooth_noise(rng: np.random.Generator) -> PixelMaker:
    """127 + 100 sin(fx x + fy y) per channel, random frequencies, plus noise (std 30)."""

    def make(label: int, side: int) -> np.ndarray:
        yy, xx = np.mgrid[0:side, 0:side].astype(np.float32)
        f = rng.uniform(0.01, 0.1, 3)
        base = 127 + 100 * np.sin(xx[..., None] * f + yy[..., None] * f[::-1])
        return np.clip(base + rng.normal(0, 30, (side, side, 3)), 0, 255).astype(np.uint8)

    return make


def noise(rng: np.random.Generator) -> PixelMaker:
    """Uniform random pixels."""
    return lambda label, side: rng.integers(0, 256, (side, side, 3), dtype=np.uint8)


def encode(pixels: np.ndarray, fmt: str = "png", quality: int = 90) -> bytes:
    """One (H, W, 3) uint8 image as PNG or JPEG bytes (quality applies to JPEG)."""
    from PIL import Image  # noqa: PLC0415

    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG" if fmt.lower() in ("jpg", "jpeg") else fmt.upper(),
                                 quality=quality)  # fmt: skip
    return out.getvalue()


def save(path: Path, pixels: np.ndarray, quality: int = 90) -> None:
    """Write one image, its format from the suffix."""
    path.write_bytes(encode(pixels, path.suffix.lstrip("."), quality))


def image_folder(
    root: Path,
    count: int,
    pixels: PixelMaker,
    *,
    side: int = 32,
    classes: int = 10,
    fmt: str = "png",
    class_dir: str = "class{label}",
    name: str = "{i:06d}",
) -> Path:
    """root/<class_dir>/<name>.<fmt>: count images, image i of class i % classes; root."""
    for i in range(count):
        label = i % classes
        folder = root / class_dir.format(label=label)
        folder.mkdir(parents=True, exist_ok=True)
        save(folder / f"{name.format(i=i)}.{fmt}", pixels(label, side))
    return root


def class_colour_folder(
    root: Path, count: int, side: int = 32, classes: int = 10, fmt: str = "png"
) -> Path:
    """image_folder of class_colours (seed 0): the learnable data set `bench train` makes."""
    pixels = class_colours(np.random.default_rng(0), classes)
    return image_folder(root, count, pixels, side=side, classes=classes, fmt=fmt)


def hdf5_dataset(root: Path, count: int, side: int = 32, classes: int = 10) -> None:
    """root/{train,val}/part-*.h5 (hpcdl.data.convert's layout) of class_colours' kind of
    images: (N, S, S, 3) uint8, count for training and max(10, count // 4) for validation."""
    from hpcdl.data.convert import write_dataset  # noqa: PLC0415

    rng = np.random.default_rng(0)
    colours = rng.integers(40, 216, (classes, 3))
    splits = {}
    for split, n in (("train", count), ("val", max(10, count // 4))):
        labels = np.arange(n) % classes
        pixels = colours[labels][:, None, None, :] + rng.normal(0, 40, (n, side, side, 3))
        splits[split] = (np.clip(pixels, 0, 255).astype(np.uint8), labels)
    write_dataset(root, splits, [f"class{k}" for k in range(classes)])
