"""thread_multiple: whether a helper thread of this process may call MPI.

hpcdl's helper threads (the reducer's allreduce thread, the diagnostics' questions to other
nodes) call MPI only when it granted MPI_THREAD_MULTIPLE. The question lives here, in the base
layer, because hpcdl.diag sits below hpcdl.comm and both ask it.
"""

from __future__ import annotations

from typing import Any


def thread_multiple(comm: Any = None) -> bool:
    """True when MPI granted MPI_THREAD_MULTIPLE (a helper thread may call it).

    comm: when given, it must also be an mpi4py communicator (hpcdl.torch's torch.distributed
    stand-ins are not, and their calls must stay on the thread that makes them)."""
    if comm is not None and not type(comm).__module__.startswith("mpi4py"):
        return False
    from mpi4py import MPI  # noqa: PLC0415 (importing mpi4py starts MPI)

    return MPI.Query_thread() >= MPI.THREAD_MULTIPLE
