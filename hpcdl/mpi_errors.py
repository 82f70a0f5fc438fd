"""lost_ranks: whether an exception is MPI's word that a rank failed (ULFM's error classes);
revoke_quietly: pass that word on to every rank of a communicator.

In the base layer because hpcdl.diag, which sits below hpcdl.comm, asks it too (its stall
inspector stops answering on a communicator that lost a rank), as do hpcdl.comm.ulfm and
hpcdl.comm.world.
"""

from __future__ import annotations

from typing import Any


def lost_ranks(exc: BaseException | None) -> bool:
    """Whether exc, or an exception it was raised from, is MPI's word that a rank failed."""
    from mpi4py import MPI  # noqa: PLC0415

    failed = {MPI.ERR_PROC_FAILED, MPI.ERR_REVOKED}
    if hasattr(MPI, "ERR_PROC_FAILED_PENDING"):
        failed.add(MPI.ERR_PROC_FAILED_PENDING)
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, MPI.Exception) and exc.Get_error_class() in failed:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def revoke_quietly(comm: Any) -> None:
    """Revoke comm (MPI_Comm_revoke), so that ranks still waiting on it leave their operation
    with MPI_ERR_REVOKED; nothing when it cannot be (revoked already, no ULFM)."""
    from mpi4py import MPI  # noqa: PLC0415

    try:
        comm.Revoke()
    except (MPI.Exception, NotImplementedError):
        pass
