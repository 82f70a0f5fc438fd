"""hpcdl.report of a run that did not finish: stopped by a NaN loss, killed (its summary never
written, its last line cut short), or still running. Real runs of hpcdl.train on the digits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

UNFINISHED = 'no "summary" event, so the run did not finish (it failed, was killed or is still'


def train(digits_dir: Path, metrics: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hpcdl.train", "--data", str(digits_dir / "train"),
         "--model", "mlp", "--batch-size", "32", "--workers", "0", "--metrics", str(metrics),
         "--metrics-every", "1", "--quiet", *args],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def report(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpcdl.report", *args], capture_output=True,
                          text=True, timeout=120, cwd=cwd)  # fmt: skip


@pytest.fixture(scope="module")
def finished(digits_dir, tmp_path_factory) -> Path:
    """Metrics of a real 2-epoch run that finished."""
    metrics = tmp_path_factory.mktemp("finished") / "m1.jsonl"
    done = train(digits_dir, metrics, "--epochs", "2")
    assert done.returncode == 0, done.stderr[-2000:]
    return metrics


def events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_run_stopped_by_a_nan_loss_is_reported_as_unfinished(digits_dir, tmp_path):
    done = train(digits_dir, tmp_path / "n.jsonl", "--epochs", "1", "--lr", "1e6")
    assert done.returncode != 0 and "loss became" in done.stderr, done.stderr[-2000:]
    steps = [e for e in events(tmp_path / "n.jsonl") if e["event"] == "step"]
    assert steps and not [e for e in events(tmp_path / "n.jsonl") if e["event"] == "summary"]
    shown = report("n.jsonl", "--out", "n.png", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    lines = [line for line in shown.stdout.splitlines() if UNFINISHED in line]
    assert len(lines) == 1, shown.stdout
    assert f"images/s is the mean of its {len(steps)} logged steps" in lines[0]
    assert (tmp_path / "n.png").exists()


def test_a_killed_run_says_its_figures_are_its_last_epochs(finished, tmp_path):
    """A SIGKILL after the last epoch: every event but the summary."""
    killed = tmp_path / "k.jsonl"
    killed.write_text("".join(line + "\n" for line in finished.read_text().splitlines()
                              if json.loads(line)["event"] != "summary"))  # fmt: skip
    shown = report("k.jsonl", "--out", "k.png", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    lines = [line for line in shown.stdout.splitlines() if UNFINISHED in line]
    assert len(lines) == 1 and "images/s is its last epoch's (epoch 2)" in lines[0]
    last_epoch = [e for e in events(killed) if e["event"] == "epoch"][-1]
    assert f"{last_epoch['images_per_s']:.1f} images/s" in shown.stdout


def test_a_finished_run_has_no_such_line(finished, tmp_path):
    shown = report(str(finished), "--out", "f.png", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert UNFINISHED not in shown.stdout
    summary = [e for e in events(finished) if e["event"] == "summary"][0]
    assert f"{summary['images_per_s']:.1f} images/s" in shown.stdout


def test_a_partial_last_line_is_skipped_with_a_note(finished, tmp_path):
    """`head -c -40`: a job killed, or a disk full, while the last line was written."""
    data = finished.read_bytes()
    cut = tmp_path / "t.jsonl"
    cut.write_bytes(data[:-40])
    lines = data.decode().splitlines()
    shown = report("t.jsonl", "--out", "t.png", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert f"t.jsonl:{len(lines)}: skipped its last line, which was cut short" in shown.stdout
    assert UNFINISHED in shown.stdout  # the cut line was the summary
    assert (tmp_path / "t.png").exists() and cut.read_bytes() == data[:-40]


def test_a_bad_line_in_the_middle_is_still_an_error(finished, tmp_path):
    lines = finished.read_text().splitlines()
    lines[3] = lines[3][:-40]
    broken = tmp_path / "b.jsonl"
    broken.write_text("\n".join(lines))  # no newline at the end either: only the LAST line may
    shown = report("b.jsonl", "--out", "b.png", cwd=tmp_path)
    assert shown.returncode == 1
    assert "hpcdl.report: error: b.jsonl:4: not a JSON object" in shown.stderr
    assert not (tmp_path / "b.png").exists()
