"""hpcdl.report --predicted: the cluster model's epoch times against a real run's."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hpcdl import report
from hpcdl.clustermodel import calibration
from hpcdl.clustermodel.calibration import (
    Calibration,
    ComputeFigures,
    LocalFigures,
    NetworkFigures,
    PfsFigures,
)


@pytest.fixture(scope="module")
def metrics(digits_dir, tmp_path_factory) -> Path:
    """Metrics of a real 2-epoch hpcdl.train run on one rank."""
    out = tmp_path_factory.mktemp("run") / "metrics.jsonl"
    train = [sys.executable, "-m", "hpcdl.train", "--data", str(digits_dir / "train"),
             "--model", "mlp", "--epochs", "2", "--batch-size", "32", "--workers", "0",
             "--metrics", str(out), "--quiet"]  # fmt: skip
    done = subprocess.run(train, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return out


def test_report_draws_predicted_against_measured_epochs(metrics, digits_dir, tmp_path, capsys):
    cal = Calibration(PfsFigures(0.001, 1e8), LocalFigures(1e9), NetworkFigures(0, 0, 0, 0),
                      ComputeFigures("mlp", 32, 20000.0, 0.001, 0.6, 400_000))  # fmt: skip
    calibration.save(tmp_path / "c.toml", cal)
    dry = [sys.executable, "-m", "hpcdl.stage", "--dry-run", "--data", str(digits_dir / "train"),
           "--calibration", str(tmp_path / "c.toml"), "--nodes", "1,2", "--batch-size", "32",
           "--epochs", "2", "--json"]  # fmt: skip
    done = subprocess.run(dry, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    predicted = tmp_path / "predicted.json"
    predicted.write_text(done.stdout.splitlines()[-1])
    out = tmp_path / "report.png"
    assert report.main([str(metrics), "--out", str(out), "--predicted", str(predicted)]) == 0
    text = capsys.readouterr().out
    one_node = json.loads(predicted.read_text())["predictions"][0]
    measured = [json.loads(line)["seconds"] for line in metrics.read_text().splitlines()
                if json.loads(line)["event"] == "epoch"]  # fmt: skip
    shown = re.findall(r"epoch (\d): ([\d.]+) s predicted, ([\d.]+) s measured", text)
    assert [int(e) for e, _, _ in shown] == [1, 2]
    assert float(shown[0][1]) == round(one_node["epoch1_s"], 2)
    assert [float(m) for _, _, m in shown] == [round(s, 2) for s in measured]
    png = tmp_path / "report-model.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_predictions_for_another_world_size_are_one_clear_error(metrics, tmp_path, capsys):
    predicted = tmp_path / "p.json"
    predicted.write_text(json.dumps({"predictions": [{"nodes": 4, "ranks_per_node": 2}]}))
    assert report.main([str(metrics), "--out", str(tmp_path / "r.png"),
                        "--predicted", str(predicted)]) == 1  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"hpcdl.report: error: --predicted {predicted} holds no prediction for the "
                   "world size of these runs; run the dry run with their --nodes and "
                   "--ranks-per-node"]  # fmt: skip
