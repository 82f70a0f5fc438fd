"""A figure's file name is checked before any work, in one line, by every command that draws:
hpcdl.report --out, report timeline --png, bench scaling --plot and bench train --report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import finished_metrics, one_line_error

from hpcdl.figure_file import FigureFileError, check_figure_path

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *args], capture_output=True, text=True, timeout=120, cwd=cwd,
        env=env,
    )  # fmt: skip


@pytest.fixture
def metrics(tmp_path) -> Path:
    return finished_metrics(tmp_path / "m1.jsonl")


def test_known_extensions_pass_and_keep_the_name(tmp_path):
    for name in ("r.png", "r.PDF", "r.svg", "sub/dir/r.jpg"):
        assert check_figure_path(str(tmp_path / name), "--out") == tmp_path / name


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("x.txt", "'.txt' is not a format matplotlib writes"),
        ("m1.jsonl", "'.jsonl' is not a format matplotlib writes"),
        ("noext", "has no extension"),
        (".png", "has no extension"),  # a hidden file's name, not an extension: savefig adds one
    ],
)
def test_an_unknown_or_missing_extension_names_the_formats(tmp_path, name, says):
    with pytest.raises(FigureFileError) as caught:
        check_figure_path(str(tmp_path / name), "--out")
    text = str(caught.value)
    assert text.startswith(f"--out {tmp_path / name}: ") and says in text
    assert "png, pdf, svg" in text and "\n" not in text


def test_a_directory_or_a_file_where_a_folder_should_be_is_refused(tmp_path, metrics):
    with pytest.raises(FigureFileError, match="is a directory; name a file in it"):
        check_figure_path(str(tmp_path), "--plot")
    with pytest.raises(FigureFileError, match="is a directory; name a file in it"):
        check_figure_path(f"{tmp_path / 'new'}/", "--plot")  # a trailing slash names a folder
    with pytest.raises(FigureFileError, match=f"{metrics} is a file, not a directory"):
        check_figure_path(str(metrics / "sub" / "x.png"), "--plot")


@pytest.mark.parametrize("out", ["x.txt", "m1.jsonl", "m1.jsonl/x.png", "noext", ".", "sub/"])
def test_report_refuses_a_bad_out_in_one_line_and_writes_nothing(tmp_path, metrics, out):
    before = sorted(os.listdir(tmp_path))
    data = metrics.read_bytes()
    line = one_line_error(run("hpcdl.report", "m1.jsonl", "--out", out, cwd=tmp_path))
    assert line.startswith(f"hpcdl.report: error: --out {out}")
    assert sorted(os.listdir(tmp_path)) == before and metrics.read_bytes() == data


def test_report_writes_the_file_it_names(tmp_path, metrics):
    done = run("hpcdl.report", "m1.jsonl", "--out", "new/r.png", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "wrote new/r.png" in done.stdout
    assert (tmp_path / "new" / "r.png").read_bytes()[:8] == PNG_MAGIC


def test_report_says_so_in_one_line_when_the_file_system_refuses_the_figure(tmp_path, metrics):
    """/proc takes no new files (not even root's): savefig's OSError, not a traceback."""
    line = one_line_error(run("hpcdl.report", "m1.jsonl", "--out", "/proc/r.png", cwd=tmp_path),
                          status=1)  # fmt: skip
    assert line.startswith("hpcdl.report: error: cannot write /proc/r.png (")


def test_timeline_refuses_a_bad_png_before_merging(tmp_path):
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": []}))
    line = one_line_error(run("hpcdl.report", "timeline", "trace.json", "--png", "t.txt",
                              cwd=tmp_path))  # fmt: skip
    assert line.startswith("hpcdl.report: error: --png t.txt: '.txt' is not a format")
    assert sorted(os.listdir(tmp_path)) == ["trace.json"]


def test_bench_scaling_refuses_a_bad_plot_before_measuring(tmp_path):
    start = time.monotonic()
    done = run("hpcdl.bench", "scaling", "--steps", "1", "--rounds", "1", "--plot", "out.txt",
               cwd=tmp_path)  # fmt: skip
    line = one_line_error(done)
    assert line.startswith("hpcdl.bench scaling: error: --plot out.txt: '.txt' is not a format")
    assert "timed steps" not in done.stdout  # the measurement never began
    assert time.monotonic() - start < 30 and os.listdir(tmp_path) == []


def test_bench_train_refuses_a_bad_report_before_making_data(tmp_path):
    env = dict(os.environ, TMPDIR=str(tmp_path))  # where the synthetic data would be made
    done = run("hpcdl.bench", "train", "--synthetic", "16", "--report", "r.txt", cwd=tmp_path,
               env=env)  # fmt: skip
    line = one_line_error(done)
    assert line.startswith("hpcdl.bench train: error: --report r.txt: '.txt' is not a format")
    assert os.listdir(tmp_path) == []
