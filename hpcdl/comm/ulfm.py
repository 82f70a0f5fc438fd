"""`--on-node-loss continue`: the survivors of lost ranks train on, in the same job (ULFM).

NOTE [recovering from lost ranks]
Needs an MPI with ULFM run in its fault-tolerant mode (`mpirun --with-ft ulfm`); mpi4py's
default error handler (MPI.ERRORS_RETURN) turns a failure into an exception. The sequence:
1. A collective that involves a dead rank fails on some survivors with MPI_ERR_PROC_FAILED
   (the reducer's allreduce, the NaN check, a loader or stall-table message); others may be
   left waiting in one. The exception unwinds the run: every resource leaves by its `abandon`
   path (NOTE [closing a run] in hpcdl/run.py), which uses no MPI.
2. That rank revokes the world communicator (MPI_Comm_revoke): every survivor still waiting
   on it gets MPI_ERR_REVOKED and unwinds the same way.
3. Every survivor calls MPI_Comm_shrink: a communicator of the survivors, agreed among them
   (the shrink runs an agreement, so all see the same membership, whatever each one saw).
   A rank lost after the shrink, while the survivors build the new world (step 4), fails
   them there; each revokes what it built and the survivors' communicator, and they shrink
   that one again (recover's loop): one recovery, one line for all the lost ranks.
4. The survivors build a new World on it (split by node again) and start the run again with
   --resume auto: from the newest checkpoint in --checkpoint-dir, with the resume path's rule
   for another world size (the global batch kept, the rest of the checkpoint's epoch read once
   each: NOTE [the rest of an epoch] in hpcdl/data/epoch_order.py). Rolling back to a
   checkpoint, not to the failed step, is what keeps the survivors' state consistent: a
   collective can complete on some ranks and fail on others, so after a failed step some
   survivors may have applied it and others not. The steps since the checkpoint are lost, as
   with a new job, but not the job: no requeue, no new start-up of MPI.
5. New rank 0 prints one line: the lost ranks and their hosts, the time from the failure to
   the new world, and the new world. Start-up on it (loaders, staging) follows; then the steps
   since the checkpoint are trained again.
6. At exit, the survivors meet in a barrier and leave with os._exit: MPI_Finalize hangs on the
   survivors of a shrink across nodes (Open MPI 5.0.11).
Limits: a lost node's daemon ends the whole job under Open MPI 5.0's mpirun, whatever the mode
(docs/multinode.md), so this survives ranks killed on nodes that stay up. The node watch leaves
a connection that ends to MPI (NodeWatch closed_is_lost=False) and still stops the job on a
silent node.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from hpcdl.comm.world import World, build_world
from hpcdl.mpi_errors import lost_ranks, revoke_quietly

FT_ENABLE = "OMPI_MCA_mpi_ft_enable"  # what `mpirun --with-ft ulfm` sets in every rank


def not_fault_tolerant_line(environ: Mapping[str, str], world_size: int) -> str | None:
    """The start-up line for --on-node-loss continue in a job Open MPI's mpirun started
    without its fault-tolerant mode (no `--with-ft ulfm`, no mpi_ft_enable): a lost rank ends
    such a job however hpcdl is configured. None where continue can work, where the job has
    one rank, or where the launcher is not Open MPI's (srun: its mode cannot be read here)."""
    under_open_mpi = "OMPI_COMM_WORLD_SIZE" in environ
    enabled = environ.get(FT_ENABLE, "").lower() in ("1", "true", "yes", "on")
    if world_size < 2 or not under_open_mpi or enabled:
        return None
    return (
        "hpcdl: --on-node-loss continue needs `mpirun --with-ft ulfm` (or hpcdl.launch, which "
        "adds it); this job was started without it, so a lost rank will end this job"
    )


def recover(world: World, failed_at: float) -> World:
    """Revoke, shrink, and return the survivors' World; new rank 0 prints the one line (NOTE
    above). failed_at: time.monotonic() when this rank saw the failure. Collective over the
    survivors."""
    from mpi4py import MPI  # noqa: PLC0415

    comm = world.comm
    while True:
        revoke_quietly(comm)
        survivors = comm.Shrink()
        try:
            new = build_world(survivors)  # revokes what it built if a rank is lost meanwhile
            started = survivors.allreduce(failed_at, op=MPI.MIN)
            break
        except MPI.Exception as exc:
            if not lost_ranks(exc):
                raise
            comm = survivors  # one more rank lost while the survivors recovered: again
    kept = MPI.Group.Translate_ranks(
        survivors.Get_group(), list(range(survivors.Get_size())), world.comm.Get_group()
    )
    if new.is_root:
        lost = sorted(set(range(world.size)) - set(kept))
        where = sorted({world.hosts[r] for r in lost}) if world.hosts else []
        print(
            f"hpcdl: lost rank{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} (on "
            f"{', '.join(where)}); the survivors formed a new world in "
            f"{time.monotonic() - started:.2f} s: "
            f"training goes on on {new.size} rank{'s' if new.size > 1 else ''} on "
            f"{new.num_nodes} node{'s' if new.num_nodes > 1 else ''}, from the latest "
            "checkpoint (--on-node-loss continue)",
            flush=True,
        )
    return new


EXIT_RANKS_LOST = 5  # as a lost node or a stall shutdown: resume with --resume auto


def lost_under_stop(world: World) -> str:
    """The one line a survivor ends the job with when ranks are lost under --on-node-loss stop
    (MPI's fault-tolerant mode told it, MPI_ERR_PROC_FAILED, instead of ending the job): the
    lost world ranks and their hosts, as far as this rank knows them."""
    from mpi4py import MPI  # noqa: PLC0415

    try:
        failed = world.comm.Get_failed()
        lost = MPI.Group.Translate_ranks(
            failed, list(range(failed.Get_size())), world.comm.Get_group()
        )
    except (MPI.Exception, NotImplementedError):
        lost = []
    lost = sorted(r for r in lost if r is not None and r >= 0)
    named = ", ".join(map(str, lost)) or "?"
    where = sorted({world.hosts[r] for r in lost if r < len(world.hosts)})
    return (
        f"lost rank{'s' if len(lost) > 1 else ''} {named}"
        + (f" (on {', '.join(where)})" if where else "")
        + f": it stopped taking part (killed, or its node failed); the job ends with exit status "
        f"{EXIT_RANKS_LOST} (--on-node-loss stop). Resume with --resume auto from the last "
        "checkpoint, or train on through lost ranks with --on-node-loss continue"
    )


def leave_without_finalize(comm: Any) -> None:
    """At exit after a recovery (atexit, before mpi4py's MPI_Finalize): meet the survivors in a
    barrier, then end the process without MPI_Finalize, which hangs on the survivors of a
    shrink across nodes (Open MPI 5.0.11; docs/multinode.md). The exit status is the one the
    process was leaving with."""
    import os  # noqa: PLC0415
    import sys  # noqa: PLC0415

    from mpi4py import MPI  # noqa: PLC0415

    try:
        comm.Barrier()
    except MPI.Exception:
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_EXIT_STATUS[0])


_EXIT_STATUS = [0]  # set by exiting(): atexit handlers cannot see sys.exit's status


def exiting(status: int) -> int:
    """Remember the status the process leaves with (for leave_without_finalize); returns it."""
    _EXIT_STATUS[0] = status
    return status
