"""16-bit greyscale PNGs become 8 bits by their high byte (value >> 8), not clipped at 255, in
every reader (image folder, encoded HDF5 rows, tar members), in `convert folder` and in the GPU
path's Pillow fallback: one decode (hpcdl.data.image_file, NOTE [image files])."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
from PIL import Image

from hpcdl.data import open_dataset
from hpcdl.data.__main__ import main
from hpcdl.data.gpu_decode import pillow_decode


@pytest.fixture
def deep(tmp_path) -> tuple[Path, dict[str, np.ndarray]]:
    """Two classes of 16-bit greyscale PNGs spanning 0..65535; {relpath: (h, w) uint16}."""
    rng = np.random.default_rng(0)
    pixels = {}
    for c in ("a", "b"):
        (tmp_path / "f" / c).mkdir(parents=True)
        for i in range(3):
            values = rng.integers(0, 65536, (12, 10), dtype=np.uint16)
            Image.fromarray(values).save(tmp_path / "f" / c / f"{i}.png")
            pixels[f"{c}/{i}.png"] = values
    assert Image.open(tmp_path / "f" / "a" / "0.png").mode == "I;16"
    return tmp_path / "f", pixels


def decoded(ds) -> dict[str, np.ndarray]:
    reader = ds.reader()
    return {i: reader.decode(i)[0] for i in range(len(ds))}


def test_every_reader_keeps_the_high_byte(deep, tmp_path):
    root, pixels = deep
    folder = open_dataset(root)
    assert folder.sample_shape == (1, 12, 10)
    want = {i: (pixels[folder.files.relpath(i)] >> 8).astype(np.uint8)[:, :, None]
            for i in range(len(folder))}  # fmt: skip
    for i, image in decoded(folder).items():
        np.testing.assert_array_equal(image, want[i])
    assert main(["convert", "folder", str(root), str(tmp_path / "enc"), "--encoded"]) == 0
    assert main(["convert", "folder", str(root), str(tmp_path / "tar"), "--to", "tar"]) == 0
    for other in (open_dataset(tmp_path / "enc" / "train"), open_dataset(tmp_path / "tar")):
        assert other.sample_shape == (1, 12, 10)
        for i, image in decoded(other).items():
            np.testing.assert_array_equal(image, want[i])


def test_convert_folder_and_the_gpu_fallback_keep_the_high_byte(deep, tmp_path):
    root, pixels = deep
    assert main(["convert", "folder", str(root), str(tmp_path / "o")]) == 0
    with h5py.File(tmp_path / "o" / "train" / "part-00000.h5") as f:
        images = f["images"][:]
    want = np.stack([pixels[k] >> 8 for k in sorted(pixels)]).astype(np.uint8)
    np.testing.assert_array_equal(images, np.repeat(want[..., None], 3, axis=3))
    assert (images == 255).mean() < 0.01  # saturated before: 99 % at 255
    blob = np.frombuffer((root / "a" / "0.png").read_bytes(), np.uint8)
    np.testing.assert_array_equal(pillow_decode(blob)[:, :, 0], pixels["a/0.png"] >> 8)
