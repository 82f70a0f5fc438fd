"""hpcdl.report: a PNG from a real training run's metrics; clear errors for unusable input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpcdl import report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def assert_valid_png(path: Path) -> None:
    import matplotlib.image  # noqa: PLC0415

    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 20_000  # three panels of lines and bars, not an empty canvas
    pixels = matplotlib.image.imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] > 400 and pixels.shape[1] > 400
    assert pixels.std() > 0.05  # something was drawn


@pytest.fixture(scope="module")
def real_metrics(digits_dir, tmp_path_factory) -> Path:
    """Metrics of one real epoch of hpcdl.train on the digits data (world of one rank)."""
    out = tmp_path_factory.mktemp("train") / "metrics.jsonl"
    cmd = [
        sys.executable, "-m", "hpcdl.train",
        "--data", str(digits_dir / "train"), "--val-data", str(digits_dir / "val"),
        "--model", "mlp", "--epochs", "1", "--batch-size", "32", "--workers", "0",
        "--metrics", str(out), "--metrics-every", "1", "--quiet",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return out


def test_report_renders_png_from_real_training_run(real_metrics, tmp_path, capsys):
    out = tmp_path / "report.png"
    assert report.main([str(real_metrics), "--out", str(out)]) == 0
    assert_valid_png(out)
    text = capsys.readouterr().out
    assert "world size 1" in text and "images/s" in text and "val acc 0." in text
    assert "data wait" in text and "compute" in text


def test_runs_side_by_side_with_staging_events(real_metrics, tmp_path, capsys):
    """A second run (2 ranks, staged) drawn beside the real one; staging row and hit rate."""
    records = [json.loads(line) for line in real_metrics.read_text().splitlines()]
    staged = []
    for r in records:
        r = dict(r, world_size=2) if r["event"] in ("start", "summary") else dict(r)
        if r["event"] == "summary":
            r["staging"] = {"files_staged": 4, "bytes_staged": 1, "hits": 30, "misses": 10}
        staged.append(r)
        if r["event"] == "step":
            staged.append(
                {"event": "staging", "epoch": r["epoch"], "step": r["step"], "time": r["time"],
                 "files_ready": 8 + 2 * r["step"], "bytes_ready": 0, "consumed_files": r["step"]}
            )  # fmt: skip
    second = write_jsonl(tmp_path / "staged.jsonl", staged)
    out = tmp_path / "two.png"
    argv = [str(real_metrics), str(second), "--out", str(out), "--labels", "plain,staged"]
    assert report.main(argv) == 0
    assert_valid_png(out)
    text = capsys.readouterr().out
    assert "plain:" in text and "staged:" in text
    assert "staging hit rate 75.0%" in text and "world size 2" in text


def test_file_without_step_events_says_what_is_missing(tmp_path):
    path = write_jsonl(
        tmp_path / "nosteps.jsonl",
        [{"event": "start", "time": 1.0, "world_size": 1, "global_batch": 32},
         {"event": "summary", "world_size": 1, "global_batch": 32, "images_per_s": 10.0}],
    )  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "hpcdl.report", str(path), "--out", str(tmp_path / "r.png")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert str(path) in done.stderr and 'no "step" events' in done.stderr
    assert not (tmp_path / "r.png").exists()


def test_malformed_line_is_named_by_file_and_line(tmp_path):
    path = tmp_path / "broken.jsonl"
    good = {"event": "step", "epoch": 0, "time": 1.0, "t_data": 0.0, "t_compute": 0.1,
            "t_comm_exposed": 0.0, "t_update": 0.0, "t_step": 0.1}  # fmt: skip
    path.write_text(json.dumps(good) + "\n" + '{"event": "step", "epoch": 0,\n')
    with pytest.raises(report.ReportError, match=rf"{path}:2: not a JSON object"):
        report.load_run(path)
    path.write_text(json.dumps(good) + "\n" + json.dumps(dict(good, t_compute=None)) + "\n")
    with pytest.raises(
        report.ReportError, match=rf"{path}:2: .*lacks numeric field\(s\) t_compute"
    ):
        report.load_run(path)
