"""`python -m tools.bench train --torch-loader`: one PyTorch DDP script with torch's DataLoader
and with hpcdl.torch, on local data and behind the slow FUSE file system."""

from __future__ import annotations

import json
import sys

import pytest

from hpcdl.bench.synthetic import class_colour_folder
from tools.bench import slowfs, train


def test_torch_loader_takes_issue_14s_setup_as_defaults():
    args = train.parse_args(["--torch-loader"])
    assert (args.synthetic, args.format, args.image_size, args.slow_fs) == (
        6000,
        "jpg",
        32,
        "5,200",
    )
    assert (args.epochs, args.workers, args.batch_size, args.ranks) == (3, 2, 32, 1)
    assert train.parse_args(["--torch-loader", "--epochs", "2"]).epochs == 2
    assert train.parse_args(["--vs-torch"]).slow_fs is None  # the other modes keep theirs


def test_torch_loader_and_vs_torch_are_two_benchmarks(capsys):
    with pytest.raises(SystemExit):
        train.parse_args(["--torch-loader", "--vs-torch"])
    assert "give one" in capsys.readouterr().err


def test_without_torch_torch_loader_says_so_and_exits_2(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    assert train.main(["--torch-loader"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs PyTorch" in err[0]


def test_both_loaders_train_locally_and_behind_the_slow_fs(tmp_path, capsys):
    why = slowfs.unavailable()
    if why:
        pytest.skip(why)  # as tests/test_slowfs.py: the benchmark's FUSE mount needs it
    class_colour_folder(tmp_path / "train", 96, side=8)
    argv = ["--torch-loader", "--data", str(tmp_path / "train"), "--slow-fs", "1,200",
            "--epochs", "2", "--batch-size", "8", "--workers", "1", "--timeout", "240",
            "--json"]  # fmt: skip
    assert train.main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    for where in ("local", "slow_fs"):
        (theirs,), (ours,) = result[where]["dataloader"], result[where]["hpcdl"]
        assert theirs["loader"] == "dataloader" and ours["loader"] == "hpcdl"
        assert theirs["images_per_epoch"] == ours["images_per_epoch"] == [96, 96]
    staged = result["slow_fs"]["hpcdl"][0]["stats"]
    assert staged["staging"] and staged["files_staged"] == 96 and staged["hits"] > 0
    assert result["local"]["hpcdl"][0]["stats"]["staging"] is False
    wall = [result["slow_fs"][side][0]["wall_s"] for side in ("hpcdl", "dataloader")]
    assert result["ratios"]["slow FS total s"] == pytest.approx(wall[0] / wall[1])
    assert any(line.startswith("slow FS: hpcdl.torch staged total / DataLoader") for line in out)
