"""Validation labels index the training classes by name, never by position (issue #19)."""

import json
import shutil

import h5py
import numpy as np
import pytest
from helpers import read_events, run_train
from PIL import Image

from hpcdl import startup
from hpcdl.comm.failure import SystemExitWithMessage
from hpcdl.comm.world import init_world
from hpcdl.config import TrainConfig

COLOURS = {"c0": (255, 0, 0), "c1": (0, 255, 0), "c2": (0, 0, 255), "c3": (255, 255, 0)}


def open_pair(train, val, batch_size=2):
    cfg = TrainConfig(data=str(train), val_data=str(val), batch_size=batch_size)
    return startup.open_datasets(cfg, init_world())  # a singleton MPI world of one rank


def colour_folder(root, classes, per_class=12, seed=0):
    """root/<class>/<i>.png: 8x8 images of the class's colour plus a little noise."""
    rng = np.random.default_rng(seed)
    for c in classes:
        (root / c).mkdir(parents=True)
        for i in range(per_class):
            noise = rng.integers(-40, 40, (8, 8, 3))
            arr = np.clip(np.array(COLOURS[c]) + noise, 0, 255).astype(np.uint8)
            Image.fromarray(arr).save(root / c / f"{i}.png")
    return root


def copy_classes(src, dst, classes):
    """dst/<class>: copies of src's class directories."""
    for c in classes:
        shutil.copytree(src / c, dst / c)
    return dst


def test_folder_val_with_fewer_classes_is_labelled_by_class_name(tmp_path):
    train = colour_folder(tmp_path / "train", ["c0", "c1", "c2"], per_class=2)
    val = copy_classes(train, tmp_path / "val", ["c0", "c2"])
    train_ds, val_ds = open_pair(train, val)
    assert val_ds.labels.tolist() == [0, 0, 2, 2]
    assert val_ds.classes == train_ds.classes == ["c0", "c1", "c2"]
    assert val_ds.num_classes == 3


def test_folder_val_class_missing_from_train_stops_at_startup(tmp_path):
    train = colour_folder(tmp_path / "train", ["c0", "c1"], per_class=2)
    val = colour_folder(tmp_path / "val", ["c0", "c3"], per_class=2)
    with pytest.raises(SystemExitWithMessage) as info:
        open_pair(train, val)
    message = info.value.message
    assert "'c3'" in message and str(train) in message and str(val) in message
    assert "\n" not in message


def write_shard(path, labels, classes=None):
    with h5py.File(path, "w") as f:
        f.create_dataset("images", data=np.zeros((len(labels), 4, 4, 1), np.uint8))
        f.create_dataset("labels", data=np.asarray(labels, np.int64))
        if classes is not None:
            f.attrs["classes"] = json.dumps(classes)
    return path


def test_hdf5_val_labels_are_mapped_through_the_stored_class_names(tmp_path):
    train = write_shard(tmp_path / "train.h5", [0, 1, 2, 0], ["a", "b", "c"])
    val = write_shard(tmp_path / "val.h5", [0, 1, 1], ["a", "c"])
    _, val_ds = open_pair(train, val)
    assert val_ds.labels.tolist() == [0, 2, 2]
    assert val_ds.classes == ["a", "b", "c"]


def test_hdf5_val_class_name_missing_from_train_stops_at_startup(tmp_path):
    train = write_shard(tmp_path / "train.h5", [0, 1, 0, 1], ["a", "b"])
    val = write_shard(tmp_path / "val.h5", [0, 1], ["a", "z"])
    with pytest.raises(SystemExitWithMessage, match="'z'") as info:
        open_pair(train, val)
    assert str(train) in info.value.message and str(val) in info.value.message


@pytest.mark.parametrize("train_classes", [None, ["a", "b", "c"]], ids=["unnamed", "named"])
def test_hdf5_val_label_beyond_the_train_classes_names_the_file(tmp_path, train_classes):
    train = write_shard(tmp_path / "train.h5", [0, 1, 2, 0], train_classes)
    (tmp_path / "val").mkdir()
    write_shard(tmp_path / "val" / "part-0.h5", [0, 1])
    bad = write_shard(tmp_path / "val" / "part-1.h5", [2, 5, 1])  # no names: labels are indices
    with pytest.raises(SystemExitWithMessage) as info:
        open_pair(train, tmp_path / "val")
    message = info.value.message
    assert str(bad) in message and "holds 5 at sample 1" in message and "3 classes" in message


def test_hdf5_val_without_names_keeps_index_labels_in_range(tmp_path):
    train = write_shard(tmp_path / "train.h5", [0, 1, 2, 0], ["a", "b", "c"])
    val = write_shard(tmp_path / "val.h5", [2, 0])
    _, val_ds = open_pair(train, val)
    assert val_ds.labels.tolist() == [2, 0] and val_ds.classes == ["a", "b", "c"]


def _val_accuracy(tmp_path, name, train, val):
    metrics = tmp_path / f"{name}.jsonl"
    proc = run_train(
        1,
        *("--data", train, "--val-data", val, "--model", "mlp", "--epochs", 4),
        *("--batch-size", 6, "--lr", 0.05, "--workers", 0, "--seed", 3),
        *("--metrics", metrics, "--checkpoint-dir", tmp_path / f"ckpt-{name}"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_events(metrics, "summary")[0]["val_accuracy"]


def test_trainer_scores_a_val_folder_with_missing_classes_like_the_full_one(tmp_path):
    train = colour_folder(tmp_path / "train", ["c0", "c1", "c2"])
    subset = copy_classes(train, tmp_path / "val-subset", ["c0", "c2"])
    # Every class present (positions equal names, right before the fix). A val folder with c1
    # present but empty is refused now, as torchvision's ImageFolder refuses it.
    reference = _val_accuracy(tmp_path, "full", train, train)
    assert reference == 1.0  # colours are trivially separable: the check below is meaningful
    assert _val_accuracy(tmp_path, "subset", train, subset) == reference


def test_trainer_refuses_a_val_class_missing_from_train_on_every_rank(tmp_path):
    train = colour_folder(tmp_path / "train", ["c0", "c1"], per_class=4)
    val = colour_folder(tmp_path / "val", ["c0", "c3"], per_class=2)
    proc = run_train(
        2,
        *("--data", train, "--val-data", val, "--model", "mlp", "--epochs", 1),
        *("--batch-size", 2, "--workers", 0, "--checkpoint-dir", tmp_path / "ckpt"),
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("hpcdl.train: error: ")
    assert "'c3'" in errors[0] and str(train) in errors[0] and str(val) in errors[0]
