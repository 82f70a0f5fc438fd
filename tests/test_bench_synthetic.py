"""hpcdl.bench.synthetic: the one maker of synthetic images for the benchmarks and harnesses."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from hpcdl.bench import synthetic
from hpcdl.data import open_dataset


def digest(root: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(root)).encode() + path.read_bytes())
    return h.hexdigest()


def test_the_same_seed_makes_the_same_files_and_another_seed_other_files(tmp_path):
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        pixels = synthetic.smooth_noise(np.random.default_rng(seed))
        synthetic.image_folder(tmp_path / name, 6, pixels, side=16, classes=3, fmt="jpg")
    assert digest(tmp_path / "a") == digest(tmp_path / "b") != digest(tmp_path / "c")


def test_an_image_folder_is_one_hpcdl_reads_with_its_labels(tmp_path):
    root = synthetic.image_folder(
        tmp_path / "f", 9, synthetic.noise(np.random.default_rng(0)), side=8, classes=3,
        class_dir="c{label}", name="{i:05d}",
    )  # fmt: skip
    assert sorted(p.name for p in root.iterdir()) == ["c0", "c1", "c2"]
    assert (root / "c1" / "00004.png").is_file()
    ds = open_dataset(str(root))
    assert len(ds) == 9 and sorted(np.bincount(ds.labels).tolist()) == [3, 3, 3]


def test_class_colours_are_learnable_the_mean_colour_names_the_class():
    make = synthetic.class_colours(np.random.default_rng(0), 4)
    means = np.array([[make(k, 32).reshape(-1, 3).mean(0) for k in range(4)] for _ in range(3)])
    spread_within = np.abs(means - means.mean(0)).max()
    between = min(
        np.abs(means[0, a] - means[0, b]).max() for a in range(4) for b in range(a + 1, 4)
    )
    assert spread_within < 5 < between


def test_encode_writes_the_format_asked_for():
    pixels = synthetic.noise(np.random.default_rng(0))(0, 8)
    assert synthetic.encode(pixels, "png").startswith(b"\x89PNG")
    assert synthetic.encode(pixels, "jpg").startswith(b"\xff\xd8")
    assert synthetic.encode(pixels, "jpg", 10) != synthetic.encode(pixels, "jpg", 95)


def test_hdf5_dataset_has_train_and_val_splits_hpcdl_reads(tmp_path):
    synthetic.hdf5_dataset(tmp_path, 40, side=8, classes=4)
    train, val = open_dataset(str(tmp_path / "train")), open_dataset(str(tmp_path / "val"))
    assert (len(train), len(val)) == (40, 10)
    assert train.kind == "hdf5" and tuple(train.sample_shape)[-2:] == (8, 8)
