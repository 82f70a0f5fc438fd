"""Typed events in a fixed-size ring, and this rank's heartbeat slot.

NOTE [the event ring]
Every rank records what it does as typed events: (kind, start, end, step, arg), times from
time.perf_counter() (CLOCK_MONOTONIC on Linux: one clock for every process of a node), arg a
kind-specific integer (a bucket's bytes, a signal's number). Recording is one tuple stored in a
preallocated list at `count % capacity`: no lock (itertools.count hands out slots atomically
under the GIL, so the allreduce thread and the training thread never share one), no allocation
beyond the tuple, nothing that waits. The timeline, the stall inspector and the flight recorder
all read this one ring.

The heartbeat slot is what other processes read without this rank's help: a row of float64
(SLOT_FIELDS) that a span into a waiting kind fills before it blocks, so a rank that never comes
back from the wait, or never reaches it, can be named by the ranks that did
(hpcdl.diag.heartbeat maps the rows of every rank of a node into one shared file). Before a
session binds it to that table, the slot is a private array and nobody reads it.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from enum import IntEnum
from functools import wraps
from typing import Any

import numpy as np

FLIGHT_EVENTS = 1000  # events a flight record keeps (the "last 1,000")


class Kind(IntEnum):
    """What an event is; the names are what traces and reports print."""

    DATA_WAIT = 1  # waiting for the loader's batch (and its copy to the device)
    H2D = 2  # host-to-device copy of a batch
    FORWARD = 3
    BACKWARD = 4
    ALLREDUCE = 5  # one gradient bucket's allreduce (arg: bytes), on the allreduce thread
    COMM_WAIT = 6  # waiting for the last gradient buckets after backward
    OPTIMIZER = 7
    SYNC = 8  # a small collective on the training thread (loss check, evaluation sums, ...)
    EVAL = 9
    CHECKPOINT = 10
    SIGNAL = 11  # a stop signal arrived (arg: its number)
    STALL = 12  # the stall inspector warned (arg: seconds waited)
    FROZEN = 13  # this process did not run for a while (SIGSTOP; arg: milliseconds)


WAITING = frozenset({Kind.DATA_WAIT, Kind.COMM_WAIT, Kind.SYNC})  # waits the inspector watches
LABELS = {
    Kind.DATA_WAIT: "data wait",
    Kind.H2D: "host-to-device copy",
    Kind.FORWARD: "forward",
    Kind.BACKWARD: "backward",
    Kind.ALLREDUCE: "allreduce",
    Kind.COMM_WAIT: "gradient allreduce wait",
    Kind.OPTIMIZER: "optimizer",
    Kind.SYNC: "collective",
    Kind.EVAL: "evaluation",
    Kind.CHECKPOINT: "checkpoint",
    Kind.SIGNAL: "signal",
    Kind.STALL: "stall warning",
    Kind.FROZEN: "process did not run",
}

# The heartbeat slot: one float64 per field, written by this rank, read by the others.
PID, STEP, STATE, SINCE, LAST_KIND, LAST_END, ALIVE, COUNT = range(8)
SLOT_FIELDS = 8


def label(kind: int) -> str:
    """A kind's name for people ("gradient allreduce wait"); unknown numbers say so."""
    try:
        return LABELS[Kind(int(kind))]
    except ValueError:
        return f"event {int(kind)}"


class Recorder:
    """This process's ring of events and its heartbeat slot (NOTE [the event ring])."""

    def __init__(self, capacity: int = FLIGHT_EVENTS) -> None:
        self.capacity = capacity
        self._events: list[tuple | None] = [None] * capacity
        self._count = itertools.count()
        self.recorded = 0  # events recorded so far (the ring keeps the last `capacity`)
        self.step = 0  # the training step in progress, set by begin_step
        self.slot = np.zeros(SLOT_FIELDS)  # rebound to a shared row by bind_slot

    def resize(self, capacity: int) -> None:
        """A ring of another size, emptied (at session start, before any thread records)."""
        self.capacity = capacity
        self._events = [None] * capacity
        self._count = itertools.count()
        self.recorded = 0

    def bind_slot(self, slot: np.ndarray) -> None:
        """Publish the heartbeat in `slot` (a row of a shared table) from now on."""
        slot[:] = self.slot
        self.slot = slot

    def begin_step(self, step: int) -> None:
        self.step = step
        self.slot[STEP] = step

    def record(self, kind: int, t0: float, t1: float, arg: int = 0) -> None:
        """A finished event of the training thread: it also ends a wait the slot shows."""
        i = next(self._count)
        self._events[i % self.capacity] = (kind, t0, t1, self.step, arg)
        self.recorded = i + 1
        slot = self.slot
        slot[LAST_KIND], slot[LAST_END], slot[COUNT] = kind, t1, i + 1
        if slot[STATE]:
            slot[STATE], slot[SINCE] = 0, t1

    def record_aside(self, kind: int, t0: float, t1: float, arg: int = 0) -> None:
        """A finished event of another thread (a bucket's allreduce): the ring only."""
        i = next(self._count)
        self._events[i % self.capacity] = (kind, t0, t1, self.step, arg)
        self.recorded = i + 1

    def enter(self, kind: int, t: float | None = None) -> float:
        """Show in the slot that this rank now waits in `kind` (since t); returns t."""
        t = time.perf_counter() if t is None else t
        self.slot[SINCE], self.slot[STATE] = t, kind
        return t

    def instant(self, kind: int, arg: int = 0) -> None:
        t = time.perf_counter()
        self.record_aside(kind, t, t, arg)

    def span(self, kind: int, arg: int = 0) -> Span:
        """`with recorder.span(Kind.SYNC): ...` records the block (and shows waits)."""
        return Span(self, kind, arg)

    def last(self, n: int) -> list[tuple]:
        """The newest n events (or fewer), oldest first; safe while others record."""
        end = self.recorded
        start = max(0, end - min(n, self.capacity))
        events = [self._events[i % self.capacity] for i in range(start, end)]
        return [e for e in events if e is not None]

    def since(self, start: int) -> tuple[list[tuple], int, int]:
        """(events numbered start.. now, the next start, how many were overwritten unread)."""
        end = self.recorded
        lost = max(0, end - self.capacity - start)
        first = start + lost
        events = [self._events[i % self.capacity] for i in range(first, end)]
        return [e for e in events if e is not None], end, lost


class Span:
    """A timed block: waits show in the slot from its start; the event is recorded at its end.

    A wait is the training thread's (the main thread's): the same wait on a helper thread (the
    GPU path's prefetch thread waiting for the loader, ahead of the step) is not this rank's
    wait and records nothing; the training thread's own wait for that thread is recorded."""

    __slots__ = ("recorder", "kind", "arg", "t0", "on")

    def __init__(self, recorder: Recorder, kind: int, arg: int) -> None:
        self.recorder, self.kind, self.arg = recorder, kind, arg
        self.t0 = 0.0
        self.on = kind not in WAITING or threading.current_thread() is threading.main_thread()

    def __enter__(self) -> Span:
        self.t0 = time.perf_counter()
        if self.on and self.kind in WAITING:
            self.recorder.enter(self.kind, self.t0)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.on:
            self.recorder.record(self.kind, self.t0, time.perf_counter(), self.arg)


RECORDER = Recorder()  # this process's ring: one per process, like a logger


def spanned(kind: Kind) -> Callable:
    """Decorator: record every call of the function as one `kind` event."""

    def wrap(fn: Callable) -> Callable:
        @wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            with RECORDER.span(kind):
                return fn(*args, **kwargs)

        return call

    return wrap
