"""scripts/test.sh's pytest-xdist workers (HPCDL_TEST_WORKERS=N; tests/conftest.py): a module
whole on one worker, and the modules that start Slurm or emulated nodes together on one, so that
no two of them run at once."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from helpers import ONE_AT_A_TIME, ONE_AT_A_TIME_GROUP, xdist_scope

REPO = Path(__file__).resolve().parents[1]


def pytest_run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=300)  # fmt: skip


def test_every_module_with_a_slurm_or_multinode_test_runs_in_the_one_at_a_time_group():
    done = pytest_run("--collect-only", "-q", "-m", "slurm or multinode", "tests")
    assert done.returncode == 0, done.stdout + done.stderr
    modules = {line.split("::")[0] for line in done.stdout.splitlines() if "::" in line}
    assert modules, done.stdout  # the marks select something
    assert modules <= ONE_AT_A_TIME, sorted(modules - ONE_AT_A_TIME)
    assert all(xdist_scope(f"{m}::t") == ONE_AT_A_TIME_GROUP for m in modules)
    assert xdist_scope("tests/test_config.py::t[a::b]") == "tests/test_config.py"


def test_two_workers_run_each_module_whole_on_one_of_them():
    done = pytest_run("-n", "2", "--dist", "loadscope", "-v", "tests/test_config.py",
                      "tests/test_figure_file.py")  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    ran = re.findall(r"^\[(gw\d)\] .*?PASSED (tests/\w+\.py)::", done.stdout, re.M)
    workers = {module: {w for w, m in ran if m == module} for _, module in ran}
    assert set(workers) == {"tests/test_config.py", "tests/test_figure_file.py"}, done.stdout
    assert all(len(w) == 1 for w in workers.values()), workers
