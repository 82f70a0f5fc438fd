"""`python -m tools.bench train --slow-fs`: bench train's runs behind the slow FUSE file system,
with the `cp -r` and DataLoader peers; the user benchmark itself takes none of it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpcdl.bench import train as user_bench
from hpcdl.bench.synthetic import class_colour_folder
from tools.bench import slowfs, train


def test_the_user_benchmark_takes_no_harness_option(capsys):
    for flag in (["--slow-fs", "5,200"], ["--vs-torch"], ["--torch-loader"], ["--torch-engine"]):
        with pytest.raises(SystemExit):
            user_bench.parse_args(flag)
        assert "unrecognized arguments" in capsys.readouterr().err


def test_slow_fs_runs_hpcdl_both_ways_and_the_peers_on_one_mount(tmp_path, capsys):
    why = slowfs.unavailable()
    if why:
        pytest.skip(why)  # as tests/test_slowfs.py: the harness's FUSE mount needs it
    class_colour_folder(tmp_path / "train", 48, side=8)
    argv = ["--data", str(tmp_path / "train"), "--slow-fs", "1,200", "--epochs", "2",
            "--batch-size", "8", "--workers", "1", "--timeout", "240", "--json"]  # fmt: skip
    assert train.main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(result["runs"]) == {"off", "on"}
    assert result["runs"]["on"]["staging_hit_rate"] > 0
    assert result["runs"]["off"]["load_s"] is None  # not measured: it would read the mount again
    peers = result["slow_fs"]
    assert peers["index"]["files"] == 48 and peers["index"]["opens"] >= 48
    assert peers["cp"]["total_s"] == pytest.approx(peers["cp"]["copy_s"] + peers["cp"]["train_s"])
    assert len(peers["cp"]["run"]["epoch_seconds"]) == 2


def test_torch_engine_runs_hpcdl_and_torchrun_on_the_same_set_and_reports_the_ratios(
    tmp_path, capsys
):
    pytest.importorskip("torch")
    why = slowfs.unavailable()
    if why:
        pytest.skip(why)  # the slow file system's half needs the harness's FUSE mount
    class_colour_folder(tmp_path / "train", 32, side=8, fmt="jpg")
    model = str(Path(__file__).parents[1] / "examples" / "torch_model.py") + ":small_cnn"
    argv = ["--torch-engine", "--data", str(tmp_path / "train"), "--model", model,
            "--augment", "flip", "--slow-fs", "1,200", "--epochs", "2", "--ranks", "1",
            "--batch-size", "8", "--workers", "1", "--timeout", "240", "--json"]  # fmt: skip
    assert train.main(argv) == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["config"]["model"] == model and result["config"]["seed"] == 0
    for setting in ("local", "slow_fs"):
        for side in ("torch", "hpcdl"):
            (run,) = result[setting][side]  # --rounds 1
            assert run["images_per_s"] > 0 and run["wall_s"] > 0
            assert len(run["epoch_seconds"]) == 2
    assert set(result["ratios"]) == {
        "local images/s (steady)", "local total s", "slow FS total s", "slow FS images/s (steady)"
    }  # fmt: skip
    assert "goal >= 1.0" in out and "goal <= 0.5" in out
