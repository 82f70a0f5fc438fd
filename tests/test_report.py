"""hpcdl.report: a PNG from a real training run's metrics; clear errors for unusable input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpcdl import metrics_file, report

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
    with pytest.raises(metrics_file.ReportError, match=rf"{path}:2: not a JSON object"):
        metrics_file.load_run(path)
    path.write_text(json.dumps(good) + "\n" + json.dumps(dict(good, t_compute=None)) + "\n")
    with pytest.raises(
        metrics_file.ReportError, match=rf"{path}:2: .*lacks numeric field\(s\) t_compute"
    ):
        metrics_file.load_run(path)


def fake_run(t0: float, epochs: int = 2, steps: int = 4, world_size: int = 1) -> list[dict]:
    """Events of one small run starting at wall-clock t0, as hpcdl.train writes them."""
    batch = 32 * world_size
    records: list[dict] = [{"event": "start", "time": t0, "world_size": world_size,
                            "global_batch": batch}]  # fmt: skip
    t = t0
    for epoch in range(epochs):
        for i in range(steps):
            t += 0.1
            records.append(
                {"event": "step", "step": epoch * steps + i + 1, "epoch": epoch, "time": t,
                 "t_data": 0.01, "t_compute": 0.07, "t_comm_exposed": 0.01, "t_update": 0.01,
                 "t_step": 0.1}
            )  # fmt: skip
            records.append(
                {"event": "staging", "epoch": epoch, "step": epoch * steps + i + 1, "time": t,
                 "files_ready": 50 + epoch * steps + i, "consumed_files": 40 + epoch * steps + i}
            )  # fmt: skip
        t += 0.5
        records.append(
            {"event": "epoch", "epoch": epoch, "time": t, "loss": 1.0 / (epoch + 1),
             "acc": 0.5 + 0.1 * epoch, "val_loss": 1.5 / (epoch + 1), "val_acc": 0.4 + 0.1 * epoch,
             "seconds": 0.9, "images_per_s": 320.0}
        )  # fmt: skip
    records.append({"event": "summary", "time": t, "world_size": world_size,
                    "global_batch": batch, "images_per_s": 320.0})  # fmt: skip
    return records


def axes_titled(fig, prefix: str) -> list:
    return [ax for ax in fig.axes if ax.get_title().startswith(prefix)]


def plotted(fig, ax) -> dict[str, tuple[list, list]]:
    """Label -> (x, y) of every labelled line on ax and on the axes sharing its x axis."""
    twins = [a for a in fig.axes if a is ax or a.get_shared_x_axes().joined(a, ax)]
    return {
        line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
        for a in twins
        for line in a.get_lines()
        if not line.get_label().startswith("_")
    }


@pytest.fixture
def appended(tmp_path) -> Path:
    """A metrics file that two runs appended to: 2 ranks and 3 epochs, then 1 rank and 2."""
    return write_jsonl(tmp_path / "m.jsonl", fake_run(1000.0, 3, world_size=2) + fake_run(1640.0))


def test_appended_runs_report_only_the_last_run(appended, tmp_path, capsys):
    run = metrics_file.load_run(appended)
    assert run.world_size == 1 and len(run.epochs) == 2 and len(run.steps) == 8
    run.label = "last"
    fig = report.build_figure([run])
    (throughput,) = axes_titled(fig, "Throughput")
    times = [x for line in throughput.get_lines() for x in line.get_xdata()]
    assert 0 <= min(times) and max(times) < 5  # the older run 640 s earlier is not on the axis
    (bars,) = axes_titled(fig, "Mean step by epoch")
    assert list(bars.get_xticks()) == [1, 2]
    out = tmp_path / "last.png"
    assert report.main([str(appended), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "holds 2 runs" in text and "--all-runs" in text
    assert "world size 1" in text and "world size 2" not in text
    assert_valid_png(out)


def test_all_runs_draws_every_run_of_the_file(appended, tmp_path, capsys):
    out = tmp_path / "all.png"
    assert report.main([str(appended), "--all-runs", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "m run 1/2 (2 ranks):" in text and "m run 2/2 (1 rank):" in text
    runs = metrics_file.load_runs(appended)
    assert [len(r.epochs) for r in runs] == [3, 2] and runs[1].t0 == 1640.0
    with pytest.raises(SystemExit):
        report.main([str(appended), "--all-runs", "--labels", "one", "--out", str(out)])


def test_learning_curve_panel_shows_loss_and_accuracy_per_epoch(appended):
    run = metrics_file.load_run(appended)
    run.label = "r"
    (ax,) = axes_titled(report.build_figure([run]), "Learning curve: r")
    lines = plotted(ax.figure, ax)
    assert lines["train loss"] == ([1, 2], [1.0, 0.5])
    assert lines["val loss"] == ([1, 2], [1.5, 0.75])
    assert lines["train acc"] == ([1, 2], [0.5, pytest.approx(0.6)])
    assert lines["val acc"] == ([1, 2], [0.4, pytest.approx(0.5)])


def test_staging_panel_y_axis_starts_at_zero(appended):
    run = metrics_file.load_run(appended)
    run.label = "r"
    (ax,) = axes_titled(report.build_figure([run]), "Staging vs consumption: r")
    assert ax.get_ylim()[0] == 0
