"""Issue 10 end to end: `hpcdl.train` on a generated JPEG folder with random crops, 1 and 2 ranks.

The classes are colours (with brightness jitter and pixel noise), so any crop or flip of an
image keeps its class and a small model learns them in a few epochs: validation accuracy far
above chance shows that the crops, the labels, the validation transform and the trained model
fit together, not only that the run ends."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import mpi_env, mpirun_cmd, read_events, run_train
from PIL import Image

COLOURS = ((200, 50, 50), (50, 190, 60), (60, 70, 200), (210, 200, 60))  # RGB, one per class
TRAIN_PER_CLASS, VAL_PER_CLASS = 12, 6
CHANCE = 1 / len(COLOURS)


def make_colour_folder(root: Path, per_class: int, size: tuple[int, int], seed: int) -> None:
    """root/c<k>/<i>.jpg: (w, h) = size images of colour k, brightness +-30, noise sigma 25."""
    rng = np.random.default_rng(seed)
    h, w = size[1], size[0]
    for k, colour in enumerate(COLOURS):
        (root / f"c{k}").mkdir(parents=True)
        for i in range(per_class):
            base = np.array(colour, np.float64) + rng.uniform(-30, 30)
            pixels = base + rng.normal(0, 25, (h, w, 3))
            image = np.clip(pixels, 0, 255).astype(np.uint8)
            Image.fromarray(image).save(root / f"c{k}" / f"{i}.jpg", quality=90)


@pytest.fixture(scope="module")
def colour_folders(tmp_path_factory) -> Path:
    """train/: 24x24 images; val/: larger, non-square 40x28 ones (w x h)."""
    root = tmp_path_factory.mktemp("colours")
    make_colour_folder(root / "train", TRAIN_PER_CLASS, (24, 24), seed=0)
    make_colour_folder(root / "val", VAL_PER_CLASS, (40, 28), seed=1)
    return root


EPOCHS, BATCH = 3, 8


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("augment", ["rrc16+flip", "rcrop16"])
def test_crops_train_to_well_above_chance_on_the_validation_folder(
    augment, ranks, colour_folders, tmp_path
):
    metrics = tmp_path / "m.jsonl"
    proc = run_train(
        ranks,
        *("--data", colour_folders / "train", "--val-data", colour_folders / "val"),
        *("--model", "mlp", "--augment", augment, "--epochs", EPOCHS, "--batch-size", BATCH),
        *("--workers", 1, "--seed", 0, "--metrics", metrics, "--quiet"),
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps_per_epoch = len(COLOURS) * TRAIN_PER_CLASS // ranks // BATCH
    summary = read_events(metrics, "summary")[0]
    assert summary["world_size"] == ranks and summary["epochs"] == EPOCHS
    assert summary["steps"] == EPOCHS * steps_per_epoch, summary
    epochs = read_events(metrics, "epoch")
    assert [e["epoch"] for e in epochs] == list(range(EPOCHS))
    assert all(e["val_acc"] is not None for e in epochs)
    assert summary["val_accuracy"] > CHANCE + 0.25, summary
    assert f"final val_acc {summary['val_accuracy']:.4f}" in proc.stdout


# hpcdl.train with one addition: before the summary (a collective every rank reaches), every
# rank hashes its parameters and BatchNorm buffers and rank 0 prints all the hashes.
TRAIN_AND_HASH = """
import hashlib, sys
from hpcdl import train
from hpcdl.backend import to_host

write_summary = train.write_summary

def hash_then_write_summary(run, *args, **kwargs):
    state = to_host(run.engine.model.params).tobytes() + to_host(run.engine.model.buffers).tobytes()
    hashes = run.world.comm.allgather(hashlib.sha256(state).hexdigest())
    if run.world.is_root:
        print("state hashes", *hashes, flush=True)
    write_summary(run, *args, **kwargs)

train.write_summary = hash_then_write_summary
sys.exit(train.main(sys.argv[1:]))
"""


def test_resnet18_takes_two_steps_on_two_ranks_on_cropped_tiny_images(tmp_path):
    """3x32x32 crops of 36x36 images; the ranks end with bitwise the same parameters."""
    make_colour_folder(tmp_path / "train", 4, (36, 36), seed=2)
    make_colour_folder(tmp_path / "val", 1, (40, 34), seed=3)
    metrics = tmp_path / "m.jsonl"
    args = ["--data", tmp_path / "train", "--val-data", tmp_path / "val", "--model", "resnet18"]
    args += ["--augment", "rcrop32", "--epochs", 1, "--batch-size", 4, "--workers", 0]
    command = [*mpirun_cmd(2), sys.executable, "-c", TRAIN_AND_HASH, *map(str, args)]
    proc = subprocess.run(
        [*command, "--metrics", str(metrics), "--quiet"],
        capture_output=True,
        text=True,
        env=mpi_env(),
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_events(metrics, "summary")[0]
    assert summary["steps"] == 2 and summary["world_size"] == 2, summary
    assert summary["val_accuracy"] is not None
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("state hashes")]
    hashes = line.split()[2:]
    assert len(hashes) == 2 and hashes[0] == hashes[1], line
