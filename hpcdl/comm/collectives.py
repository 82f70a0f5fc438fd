"""Whole-buffer collectives on numpy or cupy arrays (start-up broadcast, parameter mixing,
SyncBatchNorm statistics)."""

from __future__ import annotations

from typing import Any

import numpy as np

from hpcdl import diag
from hpcdl.backend import array_module


def _sync_device(buf: Any) -> None:
    xp = array_module(buf)
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()


@diag.spanned(diag.Kind.SYNC)  # a wait the stall inspector watches
def allreduce_mean(comm: Any, buf: Any, host_staged: bool = False) -> None:
    """Average buf over comm in place. host_staged: copy a device buffer through host memory."""
    from mpi4py import MPI  # noqa: PLC0415

    if buf.size == 0:
        return
    if array_module(buf) is not np and host_staged:
        host = buf.get()
        comm.Allreduce(MPI.IN_PLACE, host, op=MPI.SUM)
        buf.set(host / comm.Get_size())
        return
    _sync_device(buf)
    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    buf *= 1.0 / comm.Get_size()


def broadcast(comm: Any, buf: Any, root: int = 0, host_staged: bool = False) -> None:
    """Overwrite buf on every rank with root's copy."""
    if buf.size == 0:
        return
    if array_module(buf) is not np and host_staged:
        host = buf.get()
        comm.Bcast(host, root=root)
        buf.set(host)
        return
    _sync_device(buf)
    comm.Bcast(buf, root=root)


@diag.spanned(diag.Kind.SYNC)
def allreduce_sum(comm: Any, host: np.ndarray) -> None:
    """Sum a small host array over comm in place (counters, loss sums)."""
    from mpi4py import MPI  # noqa: PLC0415

    comm.Allreduce(MPI.IN_PLACE, host, op=MPI.SUM)


class SumReducer:
    """`reducer(buf)`: sum a small flat numpy/cupy buffer over comm in place (SyncBatchNorm).

    Runs on its own duplicate of comm, so it never interleaves with another collective; called
    from the training thread while GradientReducer's thread may be inside its own Allreduce
    (mpi4py initialises MPI_THREAD_MULTIPLE). host_staged: through host memory, as without a
    CUDA-aware MPI. close() frees the communicator.
    """

    def __init__(self, comm: Any, host_staged: bool = False) -> None:
        self.comm = comm.Dup()
        self.host_staged = host_staged

    def __call__(self, buf: Any) -> None:
        from mpi4py import MPI  # noqa: PLC0415

        if array_module(buf) is not np and self.host_staged:
            host = buf.get()
            self.comm.Allreduce(MPI.IN_PLACE, host, op=MPI.SUM)
            buf.set(host)
            return
        _sync_device(buf)
        self.comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)

    def close(self) -> None:
        self.comm.Free()


class AnyRank:
    """`any_rank(flag)`: True on every rank when flag is True on any rank (--precision fp16:
    every rank skips an overflowing step together).

    One int32 Allreduce (MAX) on its own duplicate of comm, like SumReducer. The flag is agreed
    explicitly rather than read from the averaged gradients: whether a sum of finite values
    overflows can depend on the order MPI added them in. close() frees the communicator."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm.Dup()
        self._flag = np.zeros(1, np.int32)

    def __call__(self, flag: bool) -> bool:
        from mpi4py import MPI  # noqa: PLC0415

        self._flag[0] = int(flag)
        self.comm.Allreduce(MPI.IN_PLACE, self._flag, op=MPI.MAX)
        return bool(self._flag[0])

    def close(self) -> None:
        self.comm.Free()
