"""hpcdl.torch.stop_requested(): a script's way to stop cleanly before the job's time limit.

hpcdl's Slurm scripts (docs/slurm.md) have Slurm send SIGUSR1 some minutes before the time
limit, and forward SIGTERM as SIGUSR1, to every rank. A training script asks once per step:

    if hvd.stop_requested():
        save_checkpoint(...)
        break                     # and exit 0: the next job of the chain resumes

The first call installs the SIGUSR1 handler (the call is the script asking for it; a handler the
script installed itself is kept, and this then reports nothing). Until then SIGUSR1 keeps its
default action, which ends the process: a script that may be signalled early calls it once
right after hvd.init(). The signal may reach only some
ranks, or reach them between two steps, so after hvd.init() on more than one rank the answer is
agreed: every rank calls it at the same point of each step, and it is True on every rank when
any rank had the signal (one 4-byte MPI_Allreduce on a communicator of its own). Before
hvd.init(), or alone, it is this process's own flag.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

import numpy as np

from hpcdl.torch import process

STOP_SIGNAL = signal.SIGUSR1


class _Stop:
    """The flag the handler sets, and the communicator the ranks agree on it over."""

    def __init__(self) -> None:
        self.flag = np.zeros(1, np.int32)  # written by the signal handler
        self.installed = False
        self.comm: Any = None

    def handle(self, signum: int, frame: Any) -> None:
        self.flag[0] = 1

    def install(self) -> None:
        self.installed = True
        if threading.current_thread() is not threading.main_thread():
            return  # Python delivers signals to the main thread only
        if signal.getsignal(STOP_SIGNAL) in (signal.SIG_DFL, None):
            signal.signal(STOP_SIGNAL, self.handle)


_stop = _Stop()


def stop_requested() -> bool:
    """True once SIGUSR1 arrived; after hvd.init() on several ranks, agreed (collective)."""
    if not _stop.installed:
        _stop.install()
    if not process.is_initialized() or process.size() == 1:
        return bool(_stop.flag[0])
    from mpi4py import MPI  # noqa: PLC0415

    if _stop.comm is None:
        _stop.comm = process.state().world.comm.Dup()
    agreed = np.zeros(1, np.int32)
    _stop.comm.Allreduce(_stop.flag.copy(), agreed, op=MPI.MAX)
    return bool(agreed[0])
