"""Data for scripts/gpu-check.sh: digits as HDF5 shards, a small learnable JPEG folder and,
where INPUT_DIR is given, the input rows' JPEG folder.

    python scripts/gpu_check_data.py DIGITS_DIR JPEG_DIR [INPUT_DIR COUNT WIDTHxHEIGHT]

INPUT_DIR gets COUNT JPEGs of WIDTHxHEIGHT in ten classes, written as `bench input --make-jpegs`
writes them (one process per core; the same function), so that the input rows and the training
runs on that folder find it made (gpu-check.sh makes all of it first, beside its install).

JPEG_DIR gets train/ (640 images) and val/ (160), 80 x 80, ten classes; each class is a
sine grating of its own orientation and frequency under noise, so a resnet18 with rrc64 crops
learns it in a few epochs and a CPU and a GPU run of the same seed can be compared.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

SIDE, CLASSES, TRAIN, VAL = 80, 10, 640, 160


def grating(k: int, rng: np.random.Generator) -> np.ndarray:
    """(SIDE, SIDE, 3) uint8: class k's grating, a random phase, colour noise."""
    yy, xx = np.mgrid[0:SIDE, 0:SIDE].astype(np.float32)
    angle = np.pi * k / CLASSES
    freq = 0.15 + 0.05 * (k % 3)
    phase = rng.uniform(0, 2 * np.pi)
    wave = np.sin(freq * (xx * np.cos(angle) + yy * np.sin(angle)) + phase)
    img = 127 + 90 * wave[..., None] + rng.normal(0, 25, (SIDE, SIDE, 3))
    return np.clip(img, 0, 255).astype(np.uint8)


def write_jpegs(root: Path) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, count in (("train", TRAIN), ("val", VAL)):
        for i in range(count):
            d = root / split / f"c{i % CLASSES}"
            d.mkdir(parents=True, exist_ok=True)
            Image.fromarray(grating(i % CLASSES, rng)).save(d / f"{i:05d}.jpg", quality=90)


def main() -> int:
    digits, jpegs = Path(sys.argv[1]), Path(sys.argv[2])
    if len(sys.argv) > 3:
        from hpcdl.bench.input import make_jpegs  # noqa: PLC0415

        count, (width, height) = int(sys.argv[4]), map(int, sys.argv[5].split("x"))
        make_jpegs(Path(sys.argv[3]), count, width, height)
        print(f"{count} JPEGs of {width}x{height} in {sys.argv[3]}")
    # each folder written under a .partial name and renamed when whole: a run cut short leaves
    # no folder that gpu-check.sh would take as made (as make_jpegs does)
    partial = digits.with_name(digits.name + ".partial")
    subprocess.run(
        [sys.executable, "-m", "hpcdl.data", "convert", "digits", str(partial)]
        + ["--shard-size", "200"],
        check=True,
    )
    partial.rename(digits)
    partial = jpegs.with_name(jpegs.name + ".partial")
    write_jpegs(partial)
    partial.rename(jpegs)
    print(f"digits in {digits}, {TRAIN} + {VAL} JPEGs in {jpegs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
