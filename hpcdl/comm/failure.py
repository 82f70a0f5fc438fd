"""No hangs: abort the whole job when one rank fails, and stop all ranks together on a signal.

- An unhandled exception on any rank prints "rank R: ..." once (from that rank) and calls
  MPI_Abort, so the other ranks never wait forever in a collective (ChainerMN's lesson).
- SIGTERM / SIGUSR1 (Slurm's time limit or --signal) may reach only some ranks. Each rank sets
  a local flag; StopAgreement combines the flags with a non-blocking MAX-allreduce on its own
  communicator, started at the beginning of a step and completed at its end, so every rank
  learns "stop after this step" at the same step boundary without adding latency.
"""

from __future__ import annotations

import signal
import sys
import traceback
from typing import Any

import numpy as np

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class UserError(Exception):
    """Wrong input from the user: printed as one sentence, no traceback, exit status 2."""


def install_abort_on_exception(comm: Any, rank: int) -> None:
    """Make an unhandled exception on this rank abort the whole MPI job after printing it once."""

    def hook(exc_type, exc, tb) -> None:
        if isinstance(exc, UserError):
            print(f"hpcdl: rank {rank}: error: {exc}", file=sys.stderr, flush=True)
        else:
            text = "".join(traceback.format_exception(exc_type, exc, tb))
            print(f"hpcdl: rank {rank} failed:\n{text}", file=sys.stderr, flush=True)
        if comm.Get_size() > 1:
            comm.Abort(2 if isinstance(exc, UserError) else 1)
        sys.exit(2 if isinstance(exc, UserError) else 1)

    sys.excepthook = hook


def agree_on_errors(comm: Any, rank: int, error: str | None) -> None:
    """Collective check: if any rank has an error, rank 0 prints the first one and all raise.

    Use it after purely local checks (paths, shapes) so that a problem seen by one rank only
    still stops every rank, and a problem seen by all is printed once, not once per rank.
    """
    errors = comm.allgather(error)
    failing = [(r, e) for r, e in enumerate(errors) if e is not None]
    if not failing:
        return
    first_rank, first = failing[0]
    if len(failing) == len(errors):
        raise SystemExitWithMessage(first if rank == 0 else None)
    where = f"rank {first_rank}" if len(failing) == 1 else f"ranks {[r for r, _ in failing]}"
    raise SystemExitWithMessage(f"{first} (on {where})" if rank == 0 else None)


class SystemExitWithMessage(Exception):
    """Raised by agree_on_errors: exit with status 2; message is None on ranks that stay quiet."""

    def __init__(self, message: str | None) -> None:
        super().__init__(message)
        self.message = message


class StopAgreement:
    """Catches SIGTERM/SIGUSR1 and agrees collectively, once per step, on whether to stop."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm.Dup()
        self.signal_name: str | None = None
        self._local = np.zeros(1, np.int32)  # written by the signal handler
        self._send = np.zeros(1, np.int32)  # snapshot: MPI must not see it change mid-call
        self._global = np.zeros(1, np.int32)
        self._request = None
        self._previous = {}
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self._local[0] = max(self._local[0], int(signum))

    def start_step(self) -> None:
        """Begin combining the flags; completes in should_stop()."""
        from mpi4py import MPI  # noqa: PLC0415

        self._send[0] = self._local[0]
        self._global[0] = 0
        self._request = self.comm.Iallreduce(self._send, self._global, op=MPI.MAX)

    def should_stop(self) -> bool:
        """True on every rank when any rank had a stop signal before its start_step()."""
        if self._request is None:
            return False
        self._request.Wait()
        self._request = None
        if self._global[0]:
            self.signal_name = signal.Signals(int(self._global[0])).name
            return True
        return False

    def close(self) -> None:
        if self._request is not None:
            self._request.Wait()
            self._request = None
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self.comm.Free()
