"""`python -m hpcdl.bench`: the dispatcher's help and errors (the benchmarks have their own)."""

import re
import subprocess
import sys

from hpcdl.bench.__main__ import BENCHMARKS


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hpcdl.bench", *args], capture_output=True, text=True, timeout=60
    )


def test_help_describes_every_benchmark():
    for flag in ("--help", "-h"):
        r = bench(flag)
        assert r.returncode == 0, r.stderr
        for name in BENCHMARKS:
            assert re.search(rf"^  {name} +\S.{{20,}}$", r.stdout, re.M), (name, r.stdout)


def test_missing_or_unknown_benchmark_is_a_usage_error():
    r = bench()
    assert r.returncode == 2 and "usage: python -m hpcdl.bench" in r.stderr
    r = bench("nope")
    assert r.returncode == 2 and r.stdout == ""
    assert "unknown benchmark 'nope'" in r.stderr and "--help" in r.stderr


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
        "(expected an HDF5 file, a directory of HDF5 shards, or an image folder "
        "root/<class>/<file>)"
    ]
