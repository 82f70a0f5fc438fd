"""`convert npz` checks the .npz before it writes anything: labels that are not integers
0..C-1 (negative, past `classes`, fractional, strings), empty arrays, a test split of another
image shape, and channels-first images are one line naming the .npz and its field, rc 2, and
OUT is left as it was."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

from hpcdl.data.__main__ import main

IMAGES = np.zeros((20, 8, 8, 3), np.uint8)


def refused(tmp_path: Path, capsys, *extra: str, **arrays) -> str:
    """The one error line of converting an .npz of these arrays; nothing left in OUT."""
    np.savez(tmp_path / "in.npz", **arrays)
    out = tmp_path / "out"
    assert main(["convert", "npz", str(tmp_path / "in.npz"), str(out), *extra]) == 2
    captured = capsys.readouterr()
    assert captured.out == "", captured.out
    assert captured.err.startswith("hpcdl.data: error: ") and captured.err.count("\n") == 1
    assert not out.exists() or not any(out.iterdir()), sorted(out.iterdir())
    return captured.err


@pytest.mark.parametrize("extra", [(), ("--val-fraction", "0.2")])
def test_negative_labels(tmp_path, capsys, extra):
    err = refused(tmp_path, capsys, *extra, images=IMAGES, labels=np.arange(20) % 4 - 1)
    assert "in.npz: field 'labels' holds -1 at sample 0; labels must be 0..C-1" in err, err


def test_labels_past_the_classes(tmp_path, capsys):
    err = refused(tmp_path, capsys, images=IMAGES, labels=np.arange(20) % 4,
                  classes=np.array(["a", "b", "c"]))  # fmt: skip
    assert "field 'labels' holds 3 at sample 3" in err and "'classes' names 3" in err, err


def test_labels_of_the_test_split(tmp_path, capsys):
    err = refused(tmp_path, capsys, x_train=IMAGES, y_train=np.arange(20) % 2,
                  x_test=IMAGES[:4], y_test=np.array([0, 1, 5, 1]))  # fmt: skip
    assert "field 'y_test' holds 5 at sample 2" in err and "0..1" in err, err


def test_fractional_and_string_labels(tmp_path, capsys):
    err = refused(tmp_path, capsys, images=IMAGES, labels=np.arange(20) * 0.5)
    assert "field 'labels' holds 0.5 at sample 1" in err and "integers" in err, err
    err = refused(tmp_path, capsys, images=IMAGES, labels=np.array(["cat", "dog"] * 10))
    assert "field 'labels' holds strings" in err and "'classes'" in err, err


def test_integral_float_labels_are_taken(tmp_path, capsys):
    np.savez(tmp_path / "f.npz", images=IMAGES, labels=(np.arange(20) % 2).astype(np.float32))
    assert main(["convert", "npz", str(tmp_path / "f.npz"), str(tmp_path / "o")]) == 0
    with h5py.File(tmp_path / "o" / "train" / "part-00000.h5") as f:
        assert f["labels"].dtype == np.int64 and f["labels"][:5].tolist() == [0, 1, 0, 1, 0]


def test_empty_arrays(tmp_path, capsys):
    err = refused(tmp_path, capsys, images=IMAGES[:0], labels=np.zeros(0, np.int64))
    assert "field 'images' holds no samples" in err, err


def test_test_split_of_another_shape(tmp_path, capsys):
    err = refused(tmp_path, capsys, x_train=IMAGES, y_train=np.arange(20) % 2,
                  x_test=np.zeros((4, 4, 8, 3), np.uint8), y_test=np.arange(4) % 2)  # fmt: skip
    assert "'x_test' holds images of shape (4, 8, 3)" in err and "(8, 8, 3)" in err, err


def test_channels_first_images(tmp_path, capsys):
    err = refused(tmp_path, capsys, images=np.zeros((20, 3, 8, 8), np.uint8),
                  labels=np.arange(20) % 2)  # fmt: skip
    assert "(N, C, H, W)" in err and "transpose(0, 2, 3, 1)" in err, err
