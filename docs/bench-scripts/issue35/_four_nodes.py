"""Shared by agreement_cost.py and idle_server_cost.py: run a script's --worker under mpirun on
the 4 emulated nodes of `tools.bench peer-staging` (as tools.bench.validate runs its jobs), and
print rank 0's windows. Needs root (tools.bench.cluster)."""

import tempfile
from pathlib import Path

import numpy as np


def run_worker(script: str) -> None:
    """`script --worker` on 4 emulated nodes, 1 rank each; prints what it printed."""
    from tools.bench.cluster import Cluster
    from tools.bench.validate import Setup, run_mpi

    setup = Setup(4, 1, 960, 20, "", epochs=4, stage_threads=8, runs=1)
    with tempfile.TemporaryDirectory(prefix="hpcdl-four-nodes-") as scratch:
        with Cluster(Path(scratch) / "cluster", nodes=setup.nodes) as cluster:
            print(run_mpi(cluster, setup, [str(Path(script).resolve()), "--worker"]), end="")


def print_windows(means: dict[str, list[float]]) -> None:
    """Each variant's median window and every window, in ms."""
    for name, seconds in means.items():
        print(f"{name:8s} median {np.median(seconds) * 1e3:6.1f} ms  windows "
              + " ".join(f"{s * 1e3:.1f}" for s in seconds), flush=True)  # fmt: skip
