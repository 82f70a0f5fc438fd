"""The stop signals of a training process: caught from its first line to its exit.

NOTE [stop signals]
SIGTERM (scancel, the time limit), SIGUSR1 (Slurm's --signal, hpcdl.launch's forwarded stop) and
SIGINT ask hpcdl.train to stop at a step boundary with a checkpoint (hpcdl.comm.failure:
StopAgreement). Their default action kills the process, and a handler that existed only while
the loop ran left two gaps: a signal during start-up (imports, MPI, torch, the model and its
broadcast, the resume, the loaders: 1-15 s) or after the loop (metrics, MPI_Finalize) killed
the ranks with no line and no checkpoint (mpirun: "exited on signal 10", exit 138). So:
- hpcdl.train calls catch() before its own imports and keeps the handler until the process
  exits. The handler only records the signal; StopAgreement reads it at every step, so a
  signal during start-up stops the run at its first step boundary (a checkpoint of one step:
  the resume from it is bitwise the uninterrupted run), and one after the last step changes
  nothing. A library use (a StopAgreement where nobody caught them before) catches them while
  it lasts and puts back what was there (release()).
- Processes the rank starts must not die of them either: mpirun passes SIGUSR1 to the rank's
  whole process group, Slurm signals every process of the job. A loader worker is a fresh
  interpreter (`python -m hpcdl.data.worker`, fork and exec); until its own code ran it would
  take the default action ("loader worker died (killed by SIGUSR1)"). So the pool starts it
  inside blocked_for_children(): a child inherits the signal mask across fork and exec, and the
  worker, once up, ignores them and only then unblocks them (ignore()); a signal that came
  meanwhile was pending and is dropped. The mask is the starting thread's only: the training
  process's own signals go to its other threads or wait until the start is over.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

_caught = 0  # the highest stop signal caught so far (SIGTERM 15 > SIGUSR1 10 > SIGINT 2), or 0
_previous: dict[int, Any] | None = None  # the handlers catch() replaced; None: not catching
_listeners: list[Any] = []  # called with each signal caught (hpcdl.diag's event, say)


def _record(signum: int, _frame: Any) -> None:
    global _caught
    _caught = max(_caught, int(signum))
    for listener in list(_listeners):
        listener(signum)


def catch() -> bool:
    """Catch the stop signals from now on (main thread only); True when this call began to
    (False: they were caught already, or this is not the main thread)."""
    global _previous
    if _previous is not None or threading.current_thread() is not threading.main_thread():
        return False
    _previous = {sig: signal.signal(sig, _record) for sig in STOP_SIGNALS}
    return True


def release() -> None:
    """Put back the handlers catch() replaced and forget what was caught (a library use ends)."""
    global _previous, _caught
    for sig, handler in (_previous or {}).items():
        signal.signal(sig, handler)
    _previous, _caught = None, 0


def caught() -> int:
    """The highest stop signal caught so far (its number), 0 when none."""
    return _caught


def on_signal(listener: Any) -> None:
    """Call listener(signum) in the main thread as each stop signal is caught (once, however
    often it is passed)."""
    if listener not in _listeners:
        _listeners.append(listener)


@contextmanager
def blocked_for_children() -> Iterator[None]:
    """Block the stop signals in this thread while the body runs: a process started inside
    inherits them blocked until it unblocks them (ignore()); this process takes any that came
    meanwhile once the body ends."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def ignore() -> None:
    """In a child started inside blocked_for_children(): ignore the stop signals, then unblock
    them (in this order: one pending now is dropped, never acted on)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
