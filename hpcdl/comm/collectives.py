"""Whole-buffer collectives on numpy or cupy arrays (start-up broadcast, parameter mixing)."""

from __future__ import annotations

from typing import Any

import numpy as np

from hpcdl.backend import array_module


def _sync_device(buf: Any) -> None:
    xp = array_module(buf)
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()


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


def allreduce_sum(comm: Any, host: np.ndarray) -> None:
    """Sum a small host array over comm in place (counters, loss sums)."""
    from mpi4py import MPI  # noqa: PLC0415

    comm.Allreduce(MPI.IN_PLACE, host, op=MPI.SUM)
