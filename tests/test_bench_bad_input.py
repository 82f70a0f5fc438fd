"""`python -m hpcdl.bench allreduce|diag|loader|torch-sync` given input they cannot measure: one
`error:` line and exit status 2, never a traceback, nan figures or a wrong benchmark's data;
and allreduce's header line is plain text (no NUL byte from MPI's library version)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import mpi_env, mpirun_cmd, one_line_error

from hpcdl.bench.torch_sync import summarise
from hpcdl.data.convert import write_dataset

REPO = Path(__file__).resolve().parents[1]


def bench(*args: str, ranks: int = 0) -> subprocess.CompletedProcess:
    """The benchmark as a user runs it: plain python (ranks 0) or under mpirun -np ranks."""
    cmd = [sys.executable, "-m", "hpcdl.bench", *map(str, args)]
    if ranks:
        cmd = mpirun_cmd(ranks) + cmd
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env=mpi_env(), cwd=REPO
    )  # fmt: skip


def test_allreduce_on_one_rank_says_it_needs_mpirun_with_two_or_more():
    done = bench("allreduce", "--repeats", "1", "--models", "resnet20")
    line = one_line_error(done)
    assert "mpirun -np N" in line and "N >= 2" in line and "1 rank" in line, line
    assert done.stdout == ""


@pytest.mark.parametrize("flag", ["--repeats", "--bucket-mb"])
def test_allreduce_refuses_a_count_below_one_before_measuring(flag):
    line = one_line_error(bench("allreduce", flag, "0", "--models", "resnet20"))
    assert flag in line, line
    done = bench("allreduce", flag, "0", "--models", "resnet20", ranks=2)
    assert done.returncode != 0 and done.stdout == "", done.stdout  # no table of nan
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert errors and all(flag in e for e in errors), done.stderr


def test_allreduce_on_two_ranks_prints_plain_text_figures():
    done = bench(
        "allreduce", "--repeats", "1", "--models", "resnet20", "--backward-factor", "0", ranks=2
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "\0" not in done.stdout and "nan" not in done.stdout, repr(done.stdout)
    header = [line for line in done.stdout.splitlines() if line.startswith("ranks: 2")]
    assert len(header) == 1 and "library: " in header[0], done.stdout


def test_diag_names_an_unknown_model_in_one_line():
    line = one_line_error(bench("diag", "--models", "nosuch"))
    assert "--models" in line and "nosuch" in line and "cnn" in line, line


@pytest.mark.parametrize("flag", ["--batch-size", "--steps", "--rounds"])
def test_diag_refuses_a_count_below_one(flag):
    line = one_line_error(bench("diag", "--models", "mlp", flag, "0"))
    assert flag in line and ">= 1" in line, line


def test_loader_given_hdf5_shards_says_it_takes_an_image_folder(tmp_path):
    x = np.zeros((16, 8, 8, 1), np.uint8)
    write_dataset(tmp_path / "d", {"train": (x, np.arange(16) % 2)}, ["a", "b"])
    data = tmp_path / "d" / "train"
    line = one_line_error(bench("loader", "--data", data, "--workers", "1", "--batch-size", "8"))
    assert str(data) in line and "HDF5" in line and "image folder" in line, line
    assert "--make-jpegs" in line, line


@pytest.mark.parametrize(
    "flag, value", [("--workers", "-1"), ("--batch-size", "0"), ("--max-images", "0")]
)
def test_loader_refuses_counts_out_of_range(tmp_path, flag, value):
    line = one_line_error(bench("loader", "--data", tmp_path, flag, value))
    assert flag in line, line


@pytest.mark.parametrize("flag", ["--ranks", "--batch-size", "--steps", "--rounds"])
def test_torch_sync_refuses_a_count_below_one_before_starting_ranks(flag):
    line = one_line_error(bench("torch-sync", "--models", "resnet20", flag, "0"))
    assert flag in line and ">= 1" in line, line


def test_torch_sync_never_reports_a_negative_exposed_time():
    """ddp's median step came out faster than local's (noise on a loaded machine): the exposed
    communication is 0, not negative, and the row says the step was within the noise."""
    records = [
        {"model": "resnet20", "mode": mode, "round": 0, "seconds": seconds}
        for mode, seconds in (("local", 1.0), ("ddp", 0.8), ("hvd", 1.5))
    ]

    class Args:
        batch_size, steps, models = 2, 10, "resnet20"

    rows = {r["mode"]: r for r in summarise({"ranks": 2, "records": records}, Args)}
    assert rows["ddp"]["exposed_comm_ms"] == 0 and rows["ddp"]["step_ms"] == pytest.approx(80)
    assert rows["ddp"]["faster_than_local"] and not rows["hvd"]["faster_than_local"]
    assert rows["hvd"]["exposed_comm_ms"] == pytest.approx(50)
    assert rows["local"]["exposed_comm_ms"] == 0


@pytest.mark.parametrize(
    "flag, value",
    [("--steps", "0"), ("--batch-size", "0"), ("--warmup", "-1"), ("--make-jpegs", "0"),
     ("--make-processes", "-1"), ("--prefetch", "0"), ("--workers", "2,-1"), ("--workers", "x")],
)  # fmt: skip
def test_input_refuses_counts_out_of_range_before_writing_jpegs(tmp_path, flag, value):
    data = tmp_path / "jpegs"
    line = one_line_error(bench("input", "--data", data, flag, value))
    assert flag in line, line
    assert not data.exists()
