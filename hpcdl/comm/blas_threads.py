"""BLAS threads per rank, chosen from the facts of where the rank runs, and set once.

NumPy's BLAS (OpenBLAS, MKL) starts one thread per core of the node unless told otherwise, so
R ranks on a node run R x cores threads that compete for the same cores: every GEMM then waits
for the slowest thread. The rule (what `torchrun` and the sbatch templates aim at, from facts
rather than a guess):

1. the cores this rank may run on are its CPU affinity mask (what mpirun or Slurm bound it to);
2. ranks of the node whose masks overlap share those cores equally: threads = cores // sharers
   (mpirun without binding, `--bind-to none`, `--oversubscribe` give every rank the whole node);
3. Slurm's `SLURM_CPUS_PER_TASK`, when set, caps it (the cores the user asked for per rank);
4. an explicit `OMP_NUM_THREADS` / `OPENBLAS_NUM_THREADS` / `MKL_NUM_THREADS` is the user's
   choice and wins, but never above the cores of rule 1.

Never fewer than 1 thread. The loader workers are separate processes with one BLAS thread each
(hpcdl.data.pool). The limit is set with threadpoolctl, which finds the BLAS NumPy loaded.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hpcdl import backend

THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


@dataclass(frozen=True)
class ThreadChoice:
    """The BLAS threads of one rank and the facts they were chosen from, said in `reason`."""

    threads: int
    reason: str


def affinity() -> frozenset[int]:
    """The CPUs this process may run on (all of them where the OS has no affinity call)."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except AttributeError:
        return frozenset(range(os.cpu_count() or 1))


def choose(
    mine: frozenset[int], node_masks: Sequence[frozenset[int]], env: Mapping[str, str]
) -> ThreadChoice:
    """Threads for a rank with CPU mask `mine` among the node's ranks' masks (its own included)."""
    cores, sharing = max(1, len(mine)), sharers(mine, node_masks)
    threads = max(1, cores // sharing)
    if sharing > 1:
        reason = f"{cores} core(s) shared by {sharing} ranks"
    else:
        reason = f"{cores} core(s) bound to this rank"
    cpus_per_task = env.get("SLURM_CPUS_PER_TASK", "")
    if cpus_per_task.isdigit() and 0 < int(cpus_per_task) < threads:
        threads, reason = int(cpus_per_task), f"SLURM_CPUS_PER_TASK={cpus_per_task}, {reason}"
    for var in THREAD_VARS:
        asked = env.get(var, "").strip()
        if asked.isdigit() and int(asked) > 0:
            threads = min(int(asked), cores)
            capped = "" if int(asked) <= cores else f", capped at the {cores} core(s) of its mask"
            return ThreadChoice(threads, f"{var}={asked} from the environment{capped}")
    return ThreadChoice(threads, reason)


@dataclass(frozen=True)
class BlasPool:
    """NumPy's BLAS as threadpoolctl reports it after the limit was set."""

    library: str  # e.g. "openblas 0.3.30"; "none" where NumPy has no threaded BLAS
    threads: int  # the threads it now runs (read back, not the ones asked for)


def current() -> BlasPool:
    """NumPy's BLAS and the threads it runs now."""
    import numpy  # noqa: F401, PLC0415  (loads the BLAS before threadpoolctl looks for it)
    import threadpoolctl  # noqa: PLC0415  (imported late: only training needs it)

    pools = [p for p in threadpoolctl.threadpool_info() if p.get("user_api") == "blas"]
    if not pools:
        return BlasPool("none", 1)
    library = f"{pools[0]['internal_api']} {pools[0].get('version') or ''}".strip()
    return BlasPool(library, int(pools[0]["num_threads"]))


def apply(threads: int) -> BlasPool:
    """Limit NumPy's BLAS to `threads` threads and read back what it runs."""
    import threadpoolctl  # noqa: PLC0415

    current()  # loads NumPy's BLAS first
    threadpoolctl.threadpool_limits(limits=threads, user_api="blas")
    pool = current()
    backend.set_blas_threads(pool.threads)  # layers choose their GEMM shapes from it
    return pool


def sharers(mine: frozenset[int], node_masks: Sequence[frozenset[int]]) -> int:
    """How many of the node's ranks (this one included) may run on this rank's cores."""
    return max(1, sum(1 for mask in node_masks if mask & mine))


def set_for_rank(
    node_comm: Any, env: Mapping[str, str] | None = None
) -> tuple[ThreadChoice, BlasPool]:
    """Choose this rank's threads against its node's ranks and run its layers on them
    (use_layer_threads); collective on node_comm."""
    mine = affinity()
    masks = node_comm.allgather(mine)
    choice = choose(mine, masks, os.environ if env is None else env)
    return choice, use_layer_threads(choice.threads)


def use_layer_threads(threads: int) -> BlasPool:
    """Run NumPy's BLAS on one thread and hpcdl.nn's convolution chunks on `threads` threads.

    Measured on the 2-core EPYC at batch 64, a step of one process owning 2 cores takes 0.80x
    (cnn) and 0.64x (resnet20) the time of whole-batch GEMMs on a 2-thread BLAS, and chunks on
    one thread beat whole-batch GEMMs on one thread (docs/PERFORMANCE.md, "Chunked
    convolutions"). Returns the BLAS as read back."""
    pool = apply(1)
    backend.set_compute_threads(threads)
    return pool


def describe(
    choice: ThreadChoice, pool: BlasPool, threads_by_rank: Sequence[int], unit: str = "per rank"
) -> str:
    """The one line rank 0 prints: threads per rank (or `unit`), why, and how they are used."""
    low, high = min(threads_by_rank), max(threads_by_rank)
    count = (
        f"{low} thread(s)" if low == high else f"{low}-{high} threads (rank 0: {choice.threads})"
    )
    split = ", convolutions split over them by images" if high > 1 else ""
    return (
        f"hpcdl: {count} {unit} ({choice.reason}); BLAS {pool.library} on "
        f"{pool.threads} thread(s){split}"
    )
