"""WebDataset tar shards for the tests: written with tarfile, from an image folder or from parts."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np
from PIL import Image

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")


def jpeg_bytes(seed: int, size: tuple[int, int] = (20, 16), grey: bool = False) -> bytes:
    """A small random JPEG, (w, h) = size."""
    rng = np.random.default_rng(seed)
    shape = (size[1], size[0]) if grey else (size[1], size[0], 3)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(out, "JPEG", quality=90)
    return out.getvalue()


def write_tar(path: Path, members: list[tuple[str, bytes]], fmt=tarfile.GNU_FORMAT) -> Path:
    """A plain tar of (member name, bytes), in that order, every mtime 0."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w", format=fmt) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tar.addfile(info, io.BytesIO(data))
    return path


def folder_samples(folder: Path) -> list[tuple[Path, int]]:
    """(image path, label) of an image folder in its sample order: sorted classes, sorted files
    (hpcdl.data.imagefolder.scan_folder)."""
    classes = sorted(d.name for d in folder.iterdir() if d.is_dir() and d.name[0] != ".")
    return [
        (f, label)
        for label, c in enumerate(classes)
        for f in sorted((folder / c).iterdir(), key=lambda p: p.name)
        if f.suffix.lower() in IMAGE_SUFFIXES
    ]


def shards_of_folder(folder: Path, out: Path, per_shard: int, label: str = "cls") -> list[Path]:
    """out/shard-NNNNNN.tar holding the folder's images in its sample order, per_shard a shard;
    label "cls": the class index; "txt": the class name."""
    classes = sorted(d.name for d in folder.iterdir() if d.is_dir() and d.name[0] != ".")
    samples = folder_samples(folder)
    shards = []
    for n, begin in enumerate(range(0, len(samples), per_shard)):
        members = []
        for i, (image, k) in enumerate(samples[begin : begin + per_shard], begin):
            value = str(k) if label == "cls" else classes[k]
            members += [(f"{i:06d}{image.suffix.lower()}", image.read_bytes())]
            members += [(f"{i:06d}.{label}", value.encode())]
        shards.append(write_tar(out / f"shard-{n:06d}.tar", members))
    return shards


def make_shards(out: Path, shards: int, per_shard: int, classes: int = 3, seed: int = 0):
    """out/s-NNNN.tar of random JPEGs (20 x 16) with .cls labels i % classes; the members."""
    everything = []
    for s in range(shards):
        members = []
        for j in range(per_shard):
            i = s * per_shard + j
            members += [
                (f"k{i:05d}.jpg", jpeg_bytes(seed + i)),
                (f"k{i:05d}.cls", b"%d" % (i % classes)),
            ]
        write_tar(out / f"s-{s:04d}.tar", members)
        everything.append(members)
    return everything
