"""`python -m hpcdl.bench` and `python -m tools.bench`: the dispatchers' help and errors (the
benchmarks and harnesses have their own)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from hpcdl.bench.__main__ import BENCHMARKS
from tools.bench.__main__ import HARNESSES

REPO = Path(__file__).resolve().parents[1]
TABLES = {"hpcdl.bench": BENCHMARKS, "tools.bench": HARNESSES}


def bench(*args: str, prog: str = "hpcdl.bench") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", prog, *args], capture_output=True, text=True, timeout=60, cwd=REPO
    )


@pytest.mark.parametrize("prog", TABLES)
def test_help_describes_every_benchmark(prog):
    for flag in ("--help", "-h"):
        r = bench(flag, prog=prog)
        assert r.returncode == 0, r.stderr
        for name in TABLES[prog]:
            assert re.search(rf"^  {name} +\S.{{20,}}$", r.stdout, re.M), (name, r.stdout)


@pytest.mark.parametrize("prog", TABLES)
def test_missing_or_unknown_benchmark_is_a_usage_error(prog):
    r = bench(prog=prog)
    assert r.returncode == 2 and f"usage: python -m {prog}" in r.stderr
    r = bench("nope", prog=prog)
    assert r.returncode == 2 and r.stdout == ""
    assert "unknown benchmark 'nope'" in r.stderr and "--help" in r.stderr


def test_the_user_benchmarks_and_the_harnesses_are_apart():
    """A harness is not offered by the product's command, and no name means two things."""
    user = {"compute", "allreduce", "loader", "input", "scaling", "train", "calibrate", "diag",
            "torch-sync"}  # fmt: skip
    assert set(BENCHMARKS) == user
    assert all(module.startswith("tools.bench.") for module in HARNESSES.values())
    assert "validate" in HARNESSES and "validate" not in BENCHMARKS
    r = bench("validate")
    assert r.returncode == 2 and "unknown benchmark 'validate'" in r.stderr


def test_train_harness_without_a_mode_points_at_the_user_benchmark():
    r = bench("train", prog="tools.bench")
    assert r.returncode == 2
    assert "python -m hpcdl.bench train" in r.stderr and "--slow-fs" in r.stderr


def test_the_scaling_driver_offers_exactly_the_models_hpcdl_nn_builds():
    """The driver keeps its own list (it does not import hpcdl.nn); hpcdl.nn owns the names."""
    from hpcdl import nn
    from hpcdl.bench import scaling

    assert scaling.MODELS == nn.MODELS


def test_a_benchmark_given_missing_data_says_so_in_one_line(tmp_path):
    r = bench("loader", "--data", str(tmp_path / "missing"), "--skip-hdf5")
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"python -m hpcdl.bench loader: error: {tmp_path / 'missing'}: no such file or directory "
        "(expected an HDF5 file, a directory of HDF5 or tar shards, or an image folder "
        "root/<class>/<file>)"
    ]
