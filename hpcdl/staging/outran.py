"""The first epoch's outran check: did readers go to the PFS because copies were not ready?

Once per job, when world rank 0 finishes the run's first epoch, its node's misses are compared
with what staging did meanwhile. Misses that a full stage dir, a too small capacity or failed
copies explain have their own message already; the others mean staging was too slow, and the
warning says what rate keeping up would have needed and what to do.
"""

from __future__ import annotations

from hpcdl.staging.status import CounterFile, StatusView


def outran_warning(
    node: int,
    need: tuple[int, int],
    status: StatusView,
    counters: CounterFile,
    local_size: int,
    seconds: float,
) -> str | None:
    """The warning for node when its first epoch outran staging, else None.

    need: (files, bytes) the first epoch read; seconds: since the stager started."""
    misses = sum(counters.totals(r)[1] for r in range(local_size))
    reads = misses + sum(counters.totals(r)[0] for r in range(local_size))
    files, nbytes = need
    if misses == 0 or status.has_flag("NOSPACE") or status.has_flag("CAPACITY_FULL"):
        return None  # all staged in time, or the capacity's own message explains the misses
    if status.field("capacity") < nbytes or status.field("failures"):
        return None  # the capacity line or the stager's failure lines explain them
    seconds = max(seconds, 1e-3)
    return (
        f"hpcdl staging on node {node}: the first epoch outran staging: {misses} of "
        f"{reads} reads went to the parallel file system because their copies were not "
        f"ready; staging copied {status.field('files_staged') / seconds:.1f} files/s "
        f"({status.field('bytes_staged') / 1e6 / seconds:.2f} MB/s), keeping up needed "
        f"{files / seconds:.1f} files/s ({nbytes / 1e6 / seconds:.2f} MB/s) over "
        f"{seconds:.2f} s; raise --stage-threads, or stage before training with a "
        "stage-only step (python -m hpcdl.stage)"
    )
