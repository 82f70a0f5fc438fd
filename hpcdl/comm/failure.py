"""No hangs and one line per failure: one rank's failure ends the job, and only it explains.

- An unhandled exception on any rank prints once, from that rank: a traceback for a bug, one
  line "hpcdl: rank R: error: ..." for a UserError (MetricsError, CheckpointWriteError: a full
  disk, say). Then MPI_Abort ends the job, so no rank waits forever in a collective (ChainerMN's
  lesson). Start-up checks do not get here: they agree (agree_on_errors) and exit with 2.
- Every other rank says at most "hpcdl: rank R: stopped because rank N failed", never a
  traceback of its own. Without this, MPI_Abort's SIGTERM also kills the loader workers of the
  other ranks, and a rank that was busy in Python blamed its dead workers ("out of memory"
  ...), a cause it had guessed.
- SIGTERM / SIGUSR1 / SIGINT (Slurm's time limit or --signal) may reach only some ranks. Each
  rank records them from its first line on (hpcdl.stop_signals, NOTE [stop signals]);
  StopAgreement combines the records with a non-blocking MAX-allreduce on its own
  communicator, started at the beginning of a step and completed at its end, so every rank
  learns "stop after this step" at the same step boundary without adding latency.

How the other ranks learn who failed (FailureNotice). An error agreement at the step boundary
cannot do it: an exception unwinds the failing rank out of the step, wherever it was (in
backward with gradient buckets in flight, in the loader, in a metrics write), so it never
reaches the boundary where the others wait; the per-step collectives that exist (the NaN
check, StopAgreement) can carry a flag only from a rank that gets to them. So the failing rank
tells the others point to point instead, on a communicator of its own:

- every rank posts one receive for a notice (ANY_SOURCE, 8 bytes: rank and exit status) when
  the job starts, and a daemon thread tests it every POLL_S. Nothing runs on the training
  thread and no collective is added: the hot path pays nothing. The thread needs
  MPI_THREAD_MULTIPLE, which mpi4py asks for (without it, notices are read only when this rank
  itself fails), and the training thread must wait in calls that release the GIL: mpi4py's
  buffer methods (Allreduce, Wait, ...) and object bcast/allgather do, object allreduce/reduce
  do not (a rank waiting in one says nothing, and the failing rank waits ACK_WAIT_S for it).
- the failing rank's excepthook sends a notice to every other rank and waits (at most
  ACK_WAIT_S) until each has printed its line and acknowledged, then prints its own message
  and calls MPI_Abort: the others' lines are out before the launcher kills them.
- a rank that gets a notice prints its line once, acknowledges, and then waits to be ended;
  anything that fails on it afterwards (dead loader workers, broken connections) is a
  consequence and prints nothing.
- when several ranks fail at once (the same bug everywhere), the first to send its notice
  reports, the lower one when two cross; the others say they stopped because of it: one
  traceback, not one per rank.

A rank killed outright (SIGKILL, a segfault) sends no notice; mpirun then names it in its own
report, and the other ranks behave as before.

Node-local state on a rank that stands down. Its training thread is stuck in a collective and
never unwinds, and MPI_Abort then kills it, so nothing on that thread can leave the node's disk
as the user asked (staged copies removed unless --keep-staged). Code that owns such state
registers a clean-up with `cleanup_on_stand_down`; the notice thread runs it after the rank's
line and before its acknowledgement, so the failing rank's MPI_Abort waits for it (at most
ACK_WAIT_S). A clean-up must not use MPI and must tolerate the training thread still running.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from hpcdl import diag, messages, stop_signals

NOTICE_TAG, ACK_TAG = 1, 2
POLL_S = 0.05  # how often the notice thread looks for a notice
ACK_WAIT_S = 5.0  # how long a failing rank waits for the others' lines before MPI_Abort
LINGER_S = 60.0  # how long a rank that stood down waits for that MPI_Abort before exiting
FORWARD_S = 0.2  # for mpirun to forward the message before it prints its MPI_Abort report

_STAND_DOWN_CLEANUPS: list[Callable[[], None]] = []  # see cleanup_on_stand_down
_HEARD_CALLBACKS: list[Callable[[], None]] = []  # see on_failure_heard


def on_failure_heard(callback: Callable[[], None]) -> None:
    """Run callback (no MPI, quick) once this rank fails or hears that another rank failed:
    that rank explains the failure, so a process that ends next is no news
    (hpcdl.comm.node_watch then stays quiet)."""
    _HEARD_CALLBACKS.append(callback)


def _failure_heard() -> None:
    while _HEARD_CALLBACKS:
        with contextlib.suppress(Exception):
            _HEARD_CALLBACKS.pop()()


@contextlib.contextmanager
def cleanup_on_stand_down(cleanup: Callable[[], None]) -> Iterator[None]:
    """While the block runs, cleanup() runs if this rank stands down because another rank failed
    (module notes: node-local state). No MPI in cleanup; it may run on the notice thread."""
    _STAND_DOWN_CLEANUPS.append(cleanup)
    try:
        yield
    finally:
        _STAND_DOWN_CLEANUPS.remove(cleanup)


class UserError(Exception):
    """Wrong input or environment (a full disk): one sentence, no traceback, exit status 2,
    or exit_status where scripts should tell the failure apart (4: a stalled loader worker)."""

    def __init__(self, message: str, exit_status: int = 2) -> None:
        super().__init__(message)
        self.exit_status = exit_status


def install_abort_on_exception(comm: Any, rank: int) -> None:
    """Make an unhandled exception on this rank abort the whole MPI job after printing it once.

    Collective (it duplicates comm for the failure notices): every rank calls it once."""
    notice = FailureNotice(comm, rank) if comm.Get_size() > 1 else None

    def hook(exc_type, exc, tb) -> None:
        status = exc.exit_status if isinstance(exc, UserError) else 1
        diag.dump_flight(f"{exc_type.__name__}: {exc}")  # the flight recorder (hpcdl.diag)
        if notice is not None:
            with contextlib.suppress(Exception):  # whatever happens here, still report and abort
                notice.report_or_stand_down(status)  # returns only on the rank that reports
        if isinstance(exc, UserError):
            messages.error(str(exc), rank)
        else:
            text = "".join(traceback.format_exception(exc_type, exc, tb))
            messages.crashed(text, rank)
        if notice is not None:
            time.sleep(FORWARD_S)
            comm.Abort(status)
        sys.exit(status)

    sys.excepthook = hook


class FailureNotice:
    """Point-to-point "rank N failed" messages, read by a daemon thread; see the module notes."""

    def __init__(self, comm: Any, rank: int) -> None:
        from mpi4py import MPI  # noqa: PLC0415

        self._mpi = MPI
        self.comm = comm.Dup()
        self.rank, self.size = rank, comm.Get_size()
        self.culprit: tuple[int, int] | None = None  # (lowest failed rank heard of, its status)
        self._failing = False  # this rank has sent its own notice
        self._stood_down = False  # this rank has printed "stopped because ..."
        self._closed = False
        self._lock = threading.Lock()  # one thread at a time on self.comm and the fields above
        self._inbox = np.zeros(2, np.int32)  # one notice: (failed rank, exit status)
        self._request = self._post()
        self._sends: list[Any] = []  # kept until the process ends: MPI may still read them
        self._threaded = MPI.Query_thread() >= MPI.THREAD_MULTIPLE
        if self._threaded:
            threading.Thread(target=self._watch, name="hpcdl-failure-notice", daemon=True).start()
        atexit.register(self.close)  # runs before mpi4py's MPI_Finalize

    def report_or_stand_down(self, status: int) -> None:
        """Called as this rank fails. Returns once the others have said their line (this rank
        reports); never returns when another rank failed first or is lower (it reports)."""
        _failure_heard()
        try:
            with self._lock:
                self._receive()
                first = self.culprit
                if first is None:
                    self._failing = True
                    self._send_all([self.rank, status], NOTICE_TAG)
            lower = first or self._wait_for_acks()
        except self._mpi.Exception:
            return  # MPI itself is broken: report this rank's error as it is
        if lower is not None:
            self._stand_down(lower)

    def close(self) -> None:
        """Stop reading notices (normal exit): cancel the posted receive before MPI_Finalize."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if not self._mpi.Is_finalized():
                # a rank of this communicator may be gone (--on-node-loss continue recovered)
                with contextlib.suppress(self._mpi.Exception):
                    self._request.Cancel()
                    self._request.Wait()

    def _post(self) -> Any:
        return self.comm.Irecv(self._inbox, source=self._mpi.ANY_SOURCE, tag=NOTICE_TAG)

    def _receive(self) -> None:
        """Take in the notices that have arrived (lock held)."""
        while not self._closed and self._request.Test():
            failed, status = int(self._inbox[0]), int(self._inbox[1])
            _failure_heard()
            if self.culprit is None or failed < self.culprit[0]:
                self.culprit = (failed, status)
            self._request = self._post()

    def _blamed(self) -> tuple[int, int] | None:
        """The failed rank this one must say it stopped for, if any (lock held)."""
        if self.culprit is None or (self._failing and self.culprit[0] > self.rank):
            return None
        return self.culprit

    def _watch(self) -> None:
        try:
            while True:
                time.sleep(POLL_S)
                with self._lock:
                    if self._closed:
                        return
                    self._receive()
                    blamed = self._blamed()
                if blamed is not None:
                    self._stand_down(blamed)
        except self._mpi.Exception:
            return  # MPI is going down; this rank's own hook still reports

    def _wait_for_acks(self) -> tuple[int, int] | None:
        """Wait until every other rank has said its line, or return a lower failed rank."""
        MPI = self._mpi
        acked: set[int] = set()
        box = np.zeros(1, np.int32)
        with self._lock:
            ack = self.comm.Irecv(box, source=MPI.ANY_SOURCE, tag=ACK_TAG)
        deadline = time.monotonic() + (ACK_WAIT_S if self._threaded else 4 * POLL_S)
        while len(acked) < self.size - 1 and time.monotonic() < deadline:
            time.sleep(0.01)
            with self._lock:
                self._receive()
                if self._blamed() is not None:
                    return self._blamed()
                MPI.Request.Testall(self._sends)
                while ack.Test():
                    acked.add(int(box[0]))
                    ack = self.comm.Irecv(box, source=MPI.ANY_SOURCE, tag=ACK_TAG)
        return None

    def _stand_down(self, culprit: tuple[int, int]) -> None:
        """Say once that this rank stops because of culprit, acknowledge, wait to be ended."""
        failed, status = culprit
        with self._lock:
            first = not self._stood_down
            if first:
                self._stood_down = True
                messages.say(f"stopped because rank {failed} failed", rank=self.rank)
        if first:
            diag.dump_flight(f"rank {failed} failed")
            for cleanup in list(_STAND_DOWN_CLEANUPS):  # before the ack: MPI_Abort waits for it
                with contextlib.suppress(Exception):
                    cleanup()
            with self._lock:
                self._send_all([self.rank], ACK_TAG, [failed])
        time.sleep(LINGER_S)  # the failing rank's MPI_Abort ends this process long before
        os._exit(status)

    def _send_all(self, values: list[int], tag: int, dests: list[int] | None = None) -> None:
        """Non-blocking sends of a few int32 to dests (default: every other rank; lock held)."""
        message = np.array(values, np.int32)
        targets = [r for r in range(self.size) if r != self.rank] if dests is None else dests
        sends = [self.comm.Isend(message, dest=r, tag=tag) for r in targets]
        self._sends += sends
        deadline = time.monotonic() + POLL_S
        while not self._mpi.Request.Testall(sends) and time.monotonic() < deadline:
            time.sleep(0.001)


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
    """Agrees collectively, once per step, on whether to stop for a stop signal; the signals are
    caught by hpcdl.stop_signals (NOTE [stop signals]), from before this agreement exists to
    the process's exit."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm.Dup()
        self.signal_name: str | None = None
        self._send = np.zeros(1, np.int32)  # snapshot: MPI must not see it change mid-call
        self._global = np.zeros(1, np.int32)
        self._request = None
        self._began_catching = stop_signals.catch()  # False under hpcdl.train: caught already
        stop_signals.on_signal(_signal_event)

    def requested(self) -> bool:
        """This rank caught a stop signal (the ranks agree on it at the next step boundary).

        For waits outside a step: the loader stops waiting on a stalled worker, so the rank
        reaches that boundary, and the checkpoint, anyway."""
        return bool(stop_signals.caught())

    def start_step(self) -> None:
        """Begin combining the flags; completes in should_stop()."""
        from mpi4py import MPI  # noqa: PLC0415

        self._send[0] = stop_signals.caught()
        self._global[0] = 0
        self._request = self.comm.Iallreduce(self._send, self._global, op=MPI.MAX)

    def should_stop(self) -> bool:
        """True on every rank when any rank had a stop signal before its start_step()."""
        if self._request is None:
            return False
        with diag.span(diag.Kind.SYNC):  # a wait the stall inspector watches
            self._request.Wait()
        self._request = None
        if self._global[0]:
            self.signal_name = signal.Signals(int(self._global[0])).name
            return True
        return False

    def close(self) -> None:
        """Every rank together: complete the step's agreement. The signals stay caught (a
        signal after the loop changes nothing), unless this agreement began catching them."""
        if self._request is not None:
            self._request.Wait()
            self._request = None
        self.abandon()
        self.comm.Free()

    def abandon(self) -> None:
        """This rank alone (it failed): leave the agreement in flight, MPI_Abort ends it; put
        back the signal handlers if this agreement installed them. Main thread only."""
        if self._began_catching:
            stop_signals.release()
            self._began_catching = False


def _signal_event(signum: int) -> None:
    diag.instant(diag.Kind.SIGNAL, int(signum))  # the flight recorder: when it came
