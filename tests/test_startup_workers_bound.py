"""--workers has an upper bound, checked at start-up: `--workers 100000` started loader
processes for minutes (130 after 15 s) and never trained. The bound is the node's: at most
WORKERS_PER_CORE per core of the job's cores there, shared by the node's ranks."""

from __future__ import annotations

import subprocess
import sys

from helpers import mpi_env, one_line_error, run_train

from hpcdl.data.worker_cores import job_cores
from hpcdl.startup_checks import WORKERS_PER_CORE, workers_error


def test_the_bound_is_per_core_of_the_node_shared_by_its_ranks():
    assert workers_error(16, 1, 4) is None and workers_error(17, 1, 4) is not None
    assert workers_error(8, 2, 4) is None and workers_error(9, 2, 4) is not None
    # more ranks than cores: each rank may still have one worker
    assert workers_error(1, 16, 2) is None and workers_error(2, 16, 2) is not None
    assert "give --workers 8 or fewer" in workers_error(9, 2, 4)


def test_a_hundred_thousand_workers_are_refused_in_one_line(digits_dir, tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "hpcdl.train", "--data", digits_dir / "train", "--model", "mlp",
         "--epochs", "1", "--workers", "100000", "--metrics", tmp_path / "m.jsonl"],
        capture_output=True, text=True, env=mpi_env(), timeout=120,
    )  # fmt: skip
    line = one_line_error(done)
    most = WORKERS_PER_CORE * len(job_cores())
    assert line == (
        "hpcdl.train: error: --workers 100000 is more loader workers than this node can run: at "
        f"most {WORKERS_PER_CORE} per core of its {len(job_cores())} core(s), shared by 1 "
        f"rank(s), is {most} per rank; give --workers {most} or fewer, or leave it out for a "
        "fair share"
    )
    assert not (tmp_path / "m.jsonl").exists()  # refused before anything was written


def test_two_ranks_of_a_node_share_its_bound(digits_dir):
    most = max(1, WORKERS_PER_CORE * len(job_cores()) // 2)
    args = ("--data", digits_dir / "train", "--model", "mlp", "--epochs", "1")
    done = run_train(2, *args, "--workers", most + 1, timeout=120)
    line = one_line_error(done)
    assert f"shared by 2 rank(s), is {most} per rank; give --workers {most} or fewer" in line
