"""The one mpirun launcher of hpcdl's benchmarks: the command and the ranks' environment.

Every benchmark that starts its own MPI job on this machine (`bench scaling`, `bench train`,
and the harnesses of tools/bench: finetune, memory, the PyTorch peers) builds the command with
mpirun_command (the venv's Open MPI beside this Python, else the one on PATH; --oversubscribe
only when the ranks outnumber the cores) and gives it child_env (root allowed as in the tests,
a fair share of BLAS threads per rank on CPU). Emulated multi-node runs go through
tools.bench.cluster, which adds hosts.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from hpcdl.backend import cpu_threads_hint
from hpcdl.comm.blas_threads import THREAD_VARS


def mpirun_command(ranks: int, oversubscribe: bool = False) -> list[str]:
    """mpirun beside this Python (the venv's Open MPI), else the one on PATH, for `ranks`
    ranks; --oversubscribe when asked or when they outnumber the cores."""
    beside = Path(sys.executable).parent / "mpirun"
    mpirun = str(beside) if beside.exists() else shutil.which("mpirun")
    if mpirun is None:
        raise FileNotFoundError(
            f"no mpirun next to {sys.executable} or on PATH; install the 'mpi' extra "
            "(pip install 'hpcdl[mpi]') or load your site's MPI module"
        )
    cmd = [mpirun, "-np", str(ranks)]
    if oversubscribe or ranks > cpu_threads_hint():
        cmd.append("--oversubscribe")
    return cmd


def child_env(ranks: int, device: str) -> dict[str, str]:
    """Environment for the ranks: root allowed, and a fair share of cores per rank on CPU."""
    env = dict(os.environ)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    if device == "cpu":  # BLAS threads of all ranks together = the cores we have
        share = str(max(1, cpu_threads_hint() // ranks))
        for var in THREAD_VARS:
            env.setdefault(var, share)
    env["PYTHONUNBUFFERED"] = "1"
    return env
