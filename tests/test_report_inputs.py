"""hpcdl.report's inputs: a binary file, a missing --predicted file or timeline path, each in
one line and before anything is drawn."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from helpers import finished_metrics, one_line_error


def report(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpcdl.report", *args], capture_output=True,
                          text=True, timeout=120, cwd=cwd)  # fmt: skip


@pytest.fixture
def metrics(tmp_path) -> Path:
    return finished_metrics(tmp_path / "m1.jsonl")


def test_a_binary_file_is_named_in_one_line(tmp_path):
    """A checkpoint (HDF5) given where the metrics go: not a UnicodeDecodeError traceback."""
    with h5py.File(tmp_path / "ckpt.h5", "w") as f:
        f["weights"] = np.arange(10, dtype=np.float32)
    line = one_line_error(report("ckpt.h5", "--out", "z.png", cwd=tmp_path), status=1)
    assert line.startswith("hpcdl.report: error: ckpt.h5: not a metrics JSON-lines file")
    assert "--metrics" in line
    assert sorted(os.listdir(tmp_path)) == ["ckpt.h5"]


def test_a_missing_predicted_file_is_said_before_anything_is_drawn(tmp_path, metrics):
    done = report("m1.jsonl", "--predicted", "nopred.json", "--out", "r.png", cwd=tmp_path)
    line = one_line_error(done)
    assert line.startswith("hpcdl.report: error: --predicted nopred.json does not exist")
    assert "wrote" not in done.stdout and not (tmp_path / "r.png").exists()


def test_a_predicted_file_that_is_not_a_dry_run_draws_nothing(tmp_path, metrics):
    (tmp_path / "p.json").write_text("[1, 2]\n")
    done = report("m1.jsonl", "--predicted", "p.json", "--out", "r.png", cwd=tmp_path)
    line = one_line_error(done)
    assert "--predicted p.json: not the JSON of hpcdl.stage --dry-run" in line
    assert not (tmp_path / "r.png").exists()


def test_predictions_for_no_run_of_these_draw_nothing(tmp_path, metrics):
    (tmp_path / "p.json").write_text(
        json.dumps({"predictions": [{"nodes": 4, "ranks_per_node": 2}]}) + "\n"
    )
    done = report("m1.jsonl", "--predicted", "p.json", "--out", "r.png", cwd=tmp_path)
    assert "holds no prediction for the world size" in one_line_error(done, status=1)
    assert not (tmp_path / "r.png").exists()


def test_timeline_of_a_path_that_does_not_exist_says_so(tmp_path):
    line = one_line_error(report("timeline", "nothere", cwd=tmp_path))
    assert line.startswith("hpcdl.report: error: nothere does not exist")
