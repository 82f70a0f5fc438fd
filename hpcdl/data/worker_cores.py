"""The cores a rank's loader workers run on, and how many workers that makes by default.

NOTE [worker cores]
Open MPI's mpirun binds each rank to one core when it starts two ranks or fewer (and to a
package above that), and every process a rank starts inherits the rank's mask. So under a
plain `mpirun -np 1` or `-np 2` the rank's loader workers and its node's stager all ran on the
rank's one core while the node's other cores idled: on a 2-core VM `mpirun -np 1 python -m
hpcdl.train --workers 2` built 279-311 images/s, 572-620 with this rule and 465-513 with
`--bind-to none` (docs/PERFORMANCE.md, "Issue 48: the workers' cores"); on a 16-core GPU node
one core fed a step that eats eleven. horovodrun passes `--bind-to none` for this; torchrun
binds nothing.
The rule, from facts the ranks of a node gather once (plan(), a pure function):
1. the job's cores on this node: the cpuset of this process's cgroup (what Slurm or a container
   gave the job; v2 `cpuset.cpus.effective`, else v1 `cpuset.effective_cpus`), else every
   online CPU;
2. the cores no rank of the node is bound to (the job's cores less the union of the ranks'
   masks) are split evenly among the node's ranks, in local-rank order;
3. a rank's workers run on its own mask plus its share of those cores. The rank itself keeps
   its mask: only the processes it starts get the wider one (spawning_on()).
Where the ranks' masks already cover the job's cores (`--bind-to none`, srun with
`--cpus-per-task`, `--map-by slot:PE=N` filling the node, more ranks than cores) nothing
changes. The default worker count is the rank's cores less one for the rank itself: its own
mask divided among the ranks that share it, plus its share of the free cores
(hpcdl.comm.blas_threads counts sharers the same way). `python -m hpcdl.stage`'s stager, alone
at work on its node, gets all of the job's cores (whole_node()). HPCDL_WORKER_CORES=inherit
keeps workers and stagers on the rank's mask (a site that places them deliberately).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from hpcdl.comm.blas_threads import affinity, sharers

ENV = "HPCDL_WORKER_CORES"  # "inherit": the workers keep the rank's mask


@dataclass(frozen=True)
class WorkerCores:
    """Where one rank's workers run. cores: the CPU set they get; count: the cores this rank
    may count on (its share of its own mask plus `extra`); extra: the free cores added to the
    rank's mask (empty where nothing changed); bound: the rank's own mask."""

    cores: frozenset[int]
    count: int
    extra: frozenset[int]
    bound: frozenset[int]

    @property
    def default_workers(self) -> int:
        """Workers when the user gave none: one core kept for the rank, at least one worker."""
        return max(1, self.count - 1)

    def describe(self) -> str:
        """The start line's words where the workers got cores beyond the rank's mask, else ''."""
        if not self.extra:
            return ""
        return (
            f"workers on cores {cpu_list(self.cores)}: the rank is bound to "
            f"{cpu_list(self.bound)}, {len(self.extra)} core(s) no rank is bound to added "
            f"({ENV}=inherit: none added)"
        )


def plan(
    mine: frozenset[int],
    node_masks: Sequence[frozenset[int]],
    local_rank: int,
    job: frozenset[int],
    env: dict[str, str] | None = None,
) -> WorkerCores:
    """This rank's WorkerCores (NOTE [worker cores]). node_masks: every local rank's mask, by
    local rank (this one's included); job: the job's cores on this node."""
    own = max(1, len(mine) // sharers(mine, node_masks))
    inherit = (env if env is not None else os.environ).get(ENV, "").strip() == "inherit"
    free = sorted(job - frozenset().union(*node_masks))
    if inherit or not free:
        return WorkerCores(mine, own, frozenset(), mine)
    ranks = max(1, len(node_masks))
    share, rest = divmod(len(free), ranks)  # the first `rest` ranks get one more
    start = local_rank * share + min(local_rank, rest)
    extra = frozenset(free[start : start + share + (local_rank < rest)])
    return WorkerCores(mine | extra, own + len(extra), extra, mine)


def for_rank(node_comm, local_rank: int) -> WorkerCores:
    """plan() for this rank with its node's masks; collective on node_comm (mpi4py)."""
    mine = affinity()
    return plan(mine, node_comm.allgather(mine), local_rank, job_cores())


def whole_node() -> frozenset[int] | None:
    """The cores for a process that works alone on its node (`hpcdl.stage`'s stager: the
    command's other ranks only wait): the job's, where this process is bound to fewer; None
    where nothing would change, or with HPCDL_WORKER_CORES=inherit."""
    if os.environ.get(ENV, "").strip() == "inherit":
        return None
    job = job_cores()
    return job if job - affinity() else None


def job_cores(
    root: Path = Path("/sys/fs/cgroup"),
    proc: Path = Path("/proc/self/cgroup"),
    online_list: Path = Path("/sys/devices/system/cpu/online"),
) -> frozenset[int]:
    """The online CPUs this process's cgroup allows (the job's cores), else every online CPU.
    root, proc, online_list: where the kernel shows them."""
    online = _read_list(online_list) or frozenset(range(os.cpu_count() or 1))
    found = _cgroup_cpus(root, proc)
    return (found & online) if found and found & online else online


def _cgroup_cpus(root: Path, proc: Path) -> frozenset[int] | None:
    """The nearest cpuset up this process's cgroup path (v2, then v1), None where none."""
    try:
        lines = proc.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":  # cgroup v2's one hierarchy
            base, name = root, "cpuset.cpus.effective"
        elif "cpuset" in controllers.split(","):
            base, name = root / "cpuset", "cpuset.effective_cpus"
        else:
            continue
        here = base / path.lstrip("/")
        while True:
            cpus = _read_list(here / name)
            if cpus:
                return cpus
            if here == base or base not in here.parents:
                break
            here = here.parent
    return None


def _read_list(path: Path) -> frozenset[int] | None:
    try:
        return parse_cpu_list(path.read_text())
    except (OSError, ValueError):
        return None


def parse_cpu_list(text: str) -> frozenset[int]:
    """The CPUs of a kernel CPU list such as "0-3,8,10-11" (empty: none)."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return frozenset(cpus)


def cpu_list(cpus: frozenset[int]) -> str:
    """The kernel's CPU list notation of cpus: "0-3,8"."""
    runs: list[str] = []
    ordered = sorted(cpus)
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        runs.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(runs)


@contextmanager
def spawning_on(cores: frozenset[int] | None) -> Iterator[None]:
    """Processes started inside run on `cores` (None or empty: as this thread). The calling
    thread's mask is widened for the start and put back; a child copies it when it is made, so
    none of its threads starts on the old mask. Where the kernel refuses (cores outside the
    cgroup), the child keeps this thread's mask."""
    if not cores or not hasattr(os, "sched_setaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, cores)
    except OSError:
        yield
        return
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
