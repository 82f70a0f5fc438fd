"""convert's options and CIFAR batches: a --val-fraction that leaves a split empty, a negative
--seed, a --resize below 1 and a CIFAR batch whose rows are not 3 x 32 x 32 are one line, rc 2,
before anything is written."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from hpcdl.data.__main__ import main


def one_line(capsys, *words: str) -> str:
    err = capsys.readouterr().err
    assert err.startswith("hpcdl.data: error: ") and err.count("\n") == 1, err
    for word in words:
        assert word in err, err
    return err


@pytest.mark.parametrize("fraction", ["0.9999", "0.0001"])
def test_a_fraction_leaving_a_split_empty(tmp_path, capsys, fraction):
    assert main(["convert", "digits", str(tmp_path / "o"), "--val-fraction", fraction]) == 2
    one_line(capsys, f"--val-fraction {fraction}", "1797")
    assert not (tmp_path / "o").exists()


def test_a_negative_seed(tmp_path, capsys):
    assert main(["convert", "digits", str(tmp_path / "o"), "--seed", "-1"]) == 2
    one_line(capsys, "--seed must be >= 0, got -1")


def test_a_resize_below_one(tmp_path, capsys):
    from helpers import make_folder

    make_folder(tmp_path / "f9")
    assert (
        main(["convert", "folder", str(tmp_path / "f9"), str(tmp_path / "o"), "--resize", "-3"])
        == 2
    )
    one_line(capsys, "--resize must be >= 1", "-3")
    assert not (tmp_path / "o").exists()


def test_a_cifar_batch_of_other_rows(tmp_path, capsys):
    rng = np.random.default_rng(0)
    for name, width in (("data_batch_1", 3072), ("test_batch", 100)):
        with open(tmp_path / name, "wb") as f:
            data = rng.integers(0, 256, (10, width), dtype=np.uint8)
            pickle.dump({b"data": data, b"labels": [0, 1] * 5}, f)
    assert main(["convert", "cifar", str(tmp_path), str(tmp_path / "o")]) == 2
    one_line(capsys, "test_batch", "not a CIFAR batch", "1000 bytes", "3072")
    assert not (tmp_path / "o").exists()
