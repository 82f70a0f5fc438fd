"""Shared by agreement_cost.py and idle_server_cost.py: run a script's --worker under mpirun on
the 4 emulated nodes of `tools.bench peer-staging` (as tools.bench.validate runs its jobs); in
the worker, the jobs' training step and a timed window of a step; print rank 0's windows.
Needs root (tools.bench.cluster)."""

import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

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


def job_train_step() -> tuple[Any, Callable[[], None], Any]:
    """In the worker: (comm, train, reducer), train() one train_step of the peer-staging jobs'
    MLP (batch 8 of 32x32 RGB, 4 classes) with the gradient reducer, compute threads set as
    hpcdl.train and bench calibrate set them. The caller closes the reducer."""
    from hpcdl.bench.compute_setup import hpcdl_setup
    from hpcdl.comm import blas_threads
    from hpcdl.comm.reducer import GradientReducer
    from hpcdl.comm.world import init_world
    from hpcdl.nn.step import train_step

    world = init_world()
    blas_threads.set_for_rank(world.node_comm)
    spec = SimpleNamespace(model="mlp", shape=(3, 32, 32), classes=4, device="cpu",
                           precision="fp32", batch_size=8)  # fmt: skip
    parts, x, y = hpcdl_setup(spec)
    reducer = GradientReducer(world.comm, parts.model.grads, 25.0, prescaled=True)
    parts = replace(parts, reducer=reducer)
    return world.comm, lambda: train_step(parts, x, y, 0.01), reducer


def window_s(comm: Any, step: Callable[[], None]) -> float:
    """The slowest rank's mean seconds of step() over 30 calls after 3 warm-up ones."""
    from mpi4py import MPI

    times = []
    for i in range(33):
        t0 = time.perf_counter()
        step()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return comm.allreduce(float(np.mean(times)), op=MPI.MAX)
