"""Conversion CLI: round trips keep pixels and labels; bad input leaves no partial output."""

import pickle
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from hpcdl.data import open_dataset
from hpcdl.data.__main__ import main
from hpcdl.data.hdf5 import HDF5Dataset


def all_samples(path):
    ds = open_dataset(path)
    x, y = ds.reader().read(np.arange(len(ds)))
    return ds, x, y


def test_digits_round_trip_via_the_cli(tmp_path):
    from sklearn.datasets import load_digits

    out = tmp_path / "digits"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "hpcdl.data",
            "convert",
            "digits",
            str(out),
            "--shard-size",
            "500",
            "--val-fraction",
            "0.25",
            "--seed",
            "3",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "samples:      1348 in 3 file(s)" in r.stdout
    tr, xt, yt = all_samples(out / "train")
    va, xv, yv = all_samples(out / "val")
    assert (len(tr), len(va)) == (1348, 449) and tr.sample_shape == (1, 8, 8)
    assert xt.dtype == np.uint8 and xt.max() == 255
    d = load_digits()
    want = np.round(d.images * 255 / 16).astype(np.uint8)[..., None]
    got_x, got_y = np.concatenate([xt, xv]), np.concatenate([yt, yv])
    # the split shuffles: compare as sets of (pixels, label) by sorting on the pixels
    order_w = np.lexsort(want.reshape(len(want), -1).T[::-1])
    order_g = np.lexsort(got_x.reshape(len(got_x), -1).T[::-1])
    np.testing.assert_array_equal(want[order_w], got_x[order_g])
    np.testing.assert_array_equal(d.target[order_w], got_y[order_g])
    np.testing.assert_allclose(tr.mean, [xt.mean()], rtol=1e-5)
    assert not list(out.glob(".hpcdl-convert-*"))


def test_npz_and_cifar_round_trips(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (30, 5, 4, 3), dtype=np.uint8)
    y = rng.integers(0, 3, 30)
    np.savez(tmp_path / "a.npz", x_train=x[:20], y_train=y[:20], x_test=x[20:], y_test=y[20:])
    assert (
        main(["convert", "npz", str(tmp_path / "a.npz"), str(tmp_path / "n"), "--shard-size", "7"])
        == 0
    )
    _, xt, yt = all_samples(tmp_path / "n" / "train")
    np.testing.assert_array_equal(xt, x[:20])
    np.testing.assert_array_equal(yt, y[:20])
    assert len(open_dataset(tmp_path / "n" / "train").files) == 3

    src = tmp_path / "cifar"
    src.mkdir()
    planar = rng.integers(0, 256, (12, 3 * 32 * 32), dtype=np.uint8)
    for k, part in enumerate([planar[:5], planar[5:10]], start=1):
        with open(src / f"data_batch_{k}", "wb") as f:
            pickle.dump({b"data": part, b"labels": list(range(len(part)))}, f)
    with open(src / "test_batch", "wb") as f:
        pickle.dump({b"data": planar[10:], b"labels": [1, 2]}, f)
    with open(src / "batches.meta", "wb") as f:
        pickle.dump({b"label_names": [b"a", b"b", b"c", b"d", b"e"]}, f)
    assert main(["convert", "cifar", str(src), str(tmp_path / "c")]) == 0
    ds, xt, yt = all_samples(tmp_path / "c" / "train")
    assert ds.classes == list("abcde") and ds.sample_shape == (3, 32, 32)
    np.testing.assert_array_equal(xt, planar[:10].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
    assert yt.tolist() == [0, 1, 2, 3, 4] * 2
    assert len(open_dataset(tmp_path / "c" / "val")) == 2


def test_folder_round_trip_and_resize(tmp_path):
    from helpers import make_folder

    images = make_folder(tmp_path / "src", per_class=2)
    assert main(["convert", "folder", str(tmp_path / "src"), str(tmp_path / "o")]) == 0
    ds, x, y = all_samples(tmp_path / "o" / "train")
    np.testing.assert_array_equal(x, np.stack([images[k] for k in sorted(images)]))
    assert y.tolist() == [0, 0, 1, 1] and ds.classes == ["cat", "dog"]


@pytest.mark.parametrize("case", ["empty", "mixed", "unreadable"])
def test_bad_folders_give_one_clear_error_and_no_output(tmp_path, capsys, case):
    from helpers import make_folder

    src = tmp_path / "src"
    if case == "empty":
        (src / "cls").mkdir(parents=True)
        msg = "no images found"
    else:
        make_folder(src, per_class=2)
        if case == "mixed":
            Image.fromarray(np.zeros((9, 9, 3), np.uint8)).save(src / "dog" / "z.png")
            msg = "pass --resize S"
        else:
            (src / "dog" / "z.png").write_bytes(b"\x89PNG broken")
            msg = "z.png: unreadable image"
    out = tmp_path / "out"
    assert main(["convert", "folder", str(src), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hpcdl.data: error: ") and msg in err and err.count("\n") == 1
    assert not out.exists() or not any(out.iterdir())
    if case == "mixed":
        assert main(["convert", "folder", str(src), str(out), "--resize", "8"]) == 0
        assert open_dataset(out / "train").sample_shape == (3, 8, 8)


def test_existing_output_is_not_overwritten_and_inspect_prints_a_summary(tmp_path, capsys):
    assert main(["convert", "digits", str(tmp_path), "--val-fraction", "0"]) == 0
    assert not (tmp_path / "val").exists()
    assert main(["convert", "digits", str(tmp_path)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "train")]) == 0
    out = capsys.readouterr().out
    assert "1797 in 1 file(s)" in out and "(1, 8, 8)" in out and "10 (0: 178" in out
    assert isinstance(open_dataset(tmp_path / "train"), HDF5Dataset)
