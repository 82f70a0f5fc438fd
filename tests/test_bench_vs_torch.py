"""`python -m tools.bench train --vs-torch`: hpcdl.train against PyTorch DDP on the same data."""

from __future__ import annotations

import json
import sys

import h5py
import pytest

from hpcdl.bench.synthetic import class_colour_folder, hdf5_dataset
from hpcdl.data import open_dataset
from tools.bench import torch_ddp, train


def test_synthetic_hdf5_is_an_hdf5_data_set_hpcdl_reads(tmp_path):
    hdf5_dataset(tmp_path, 40, side=8)
    ds = open_dataset(str(tmp_path / "train"))
    assert len(ds) == 40 and ds.sample_shape == (3, 8, 8)
    with h5py.File(next((tmp_path / "train").glob("*.h5")), "r") as f:
        assert len(f.attrs["mean"]) == 3 and len(f.attrs["std"]) == 3


def test_without_torch_vs_torch_says_so_and_exits_2(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    assert train.main(["--vs-torch"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs PyTorch" in err[0]


def test_vs_torch_takes_the_issue_12_setup_as_defaults():
    args = train.parse_args(["--vs-torch"])
    assert (args.model, args.ranks, args.batch_size, args.workers) == ("cnn", 2, 64, 1)
    assert (args.format, args.augment) == ("h5", "crop4+flip")
    assert train.parse_args(["--vs-torch", "--model", "mlp"]).model == "mlp"
    assert train.parse_args(["--slow-fs", "5,200"]).model == "mlp"  # the other modes keep theirs


def test_vs_torch_rejects_what_the_torch_side_does_not_do(capsys):
    with pytest.raises(SystemExit):
        train.parse_args(["--vs-torch", "--augment", "rrc24+flip"])
    assert "cropP and flip only" in capsys.readouterr().err


def test_steady_state_skips_the_first_epoch():
    assert torch_ddp.steady_images_per_s([10.0, 1.0, 1.0], [100, 100, 100]) == 100.0
    assert torch_ddp.steady_images_per_s([2.0], [100]) == 50.0


def test_both_sides_train_two_ranks_and_give_a_ratio(tmp_path, capsys):
    pytest.importorskip("torch")
    hdf5_dataset(tmp_path, 256, side=16)
    argv = ["--vs-torch", "--data", str(tmp_path / "train"), "--batch-size", "16",
            "--epochs", "2", "--timeout", "240", "--json"]  # fmt: skip
    assert train.main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (ours,), (theirs,) = result["hpcdl_images_per_s"], result["torch_images_per_s"]
    assert ours > 0 and theirs > 0
    assert result["ratio"] == pytest.approx(ours / theirs)
    assert result["config"]["ranks"] == 2 and result["config"]["augment"] == "crop4+flip"


def test_vs_torch_wants_hdf5_data(tmp_path, capsys):
    pytest.importorskip("torch")
    class_colour_folder(tmp_path, 10, side=8)
    assert train.main(["--vs-torch", "--data", str(tmp_path)]) == 2
    assert "reads HDF5 data" in capsys.readouterr().err
