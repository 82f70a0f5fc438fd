"""`hpcdl.stage --dry-run --calibration` refuses what the real run refuses, as the plain dry run
does: a --batch-size with no step at one of the --nodes counts (it printed a row of 0 files and
a made-up images/s), and a --stage-dir inside the data."""

from __future__ import annotations

from pathlib import Path

from helpers import make_tree, stage_cli

from hpcdl.clustermodel import calibration
from hpcdl.clustermodel.calibration import (
    Calibration,
    ComputeFigures,
    LocalFigures,
    NetworkFigures,
    PfsFigures,
)

CAL = Calibration(
    PfsFigures(open_latency_s=0.01, thread_bandwidth_Bps=1e8),
    LocalFigures(write_bandwidth_Bps=1e9),
    NetworkFigures(1e-5, 1e-9, 1e-4, 1e-8, "hierarchical"),
    ComputeFigures("mlp", 8, v0=800.0, t=0.01, backward_fraction=0.5, gradient_bytes=4_000_000),
)


def calibrated(tmp_path: Path) -> tuple[Path, Path]:
    path = tmp_path / "c.toml"
    calibration.save(path, CAL)
    return path, make_tree(tmp_path / "tree", 40, 100).root


def model_dry_run(cal: Path, *args) -> object:
    return stage_cli("--dry-run", "--calibration", cal, "--ranks-per-node", 2, *args)


def test_a_batch_with_no_step_at_one_node_count_is_refused_naming_it(tmp_path):
    cal, tree = calibrated(tmp_path)
    args = ("--data", tree, "--files-only", "--batch-size", 10)
    done = model_dry_run(cal, *args, "--nodes", "1,2,4")
    assert (done.returncode, done.stdout) == (2, ""), done.stdout + done.stderr
    assert done.stderr == (
        f"hpcdl.stage: error: at --nodes 4: --batch-size 10 is larger than each rank's shard of "
        f"{tree} (40 samples / 8 ranks = 5); use a batch size <= 5 or fewer ranks\n"
    )
    fits = model_dry_run(cal, *args, "--nodes", "1,2")
    assert fits.returncode == 0, fits.stderr


def test_a_described_data_set_too_small_for_the_batch_is_refused(tmp_path):
    cal, _ = calibrated(tmp_path)
    args = ("--dataset-files", 30, "--dataset-bytes", "1e6", "--nodes", "2", "--batch-size", 10)
    done = model_dry_run(cal, *args)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith(
        "hpcdl.stage: error: at --nodes 2: --batch-size 10 is larger than each rank's shard of "
        "--dataset-files 30 (30 samples / 4 ranks = 7)"
    ), done.stderr


def test_a_stage_dir_inside_the_data_is_refused_and_not_created(tmp_path):
    cal, tree = calibrated(tmp_path)
    args = ("--data", tree, "--files-only", "--nodes", "1", "--batch-size", 4)
    done = model_dry_run(cal, *args, "--stage-dir", tree / "stage")
    assert (done.returncode, done.stdout) == (2, ""), done.stdout + done.stderr
    assert done.stderr.startswith(f"hpcdl.stage: error: --stage-dir {tree / 'stage'} overlaps")
    assert not (tree / "stage").exists()
