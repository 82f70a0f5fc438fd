"""Diagnostics are events, not logs: why is my job slow, or stuck?

Each rank records typed events (data wait, forward, backward, each bucket's allreduce, the
optimizer, evaluation, checkpoints, signals) in a fixed-size ring (hpcdl.diag.events). Three
readers share that one ring:
- the timeline (--timeline FILE, hpcdl.diag.timeline): Chrome trace JSON, one track per rank;
- the stall inspector (--stall-warning, --stall-shutdown, hpcdl.diag.stall): a rank that waits
  too long names the ranks that have not arrived, from their heartbeats, never asking them;
- the flight recorder (hpcdl.diag.flight): the last 1,000 events of each rank, written to the
  run's directory when the run ends abnormally; `python -m hpcdl.report last DIR` reads them.
Nothing on the hot path waits for a collective to record an event.

This is a base-layer package: it imports the standard library, numpy and hpcdl.messages only;
training, the communicators, the loaders and hpcdl.torch call into it. The API for them:

    from hpcdl import diag
    with diag.span(diag.Kind.OPTIMIZER):      # a timed block; waits show in the heartbeat
        ...
    diag.record(diag.Kind.FORWARD, t0, t1)    # a block timed already (perf_counter seconds)
    diag.begin_step(step)                     # the step the next events belong to
    diag.dump_flight("why")                   # an abnormal end: write this rank's record
    session = diag.DiagSession.open(comm, node_comm, diag.DiagOptions(timeline="t.json"))
    ...; session.close()                      # collective; rank 0 writes the timeline
"""

from __future__ import annotations

from hpcdl.diag.events import RECORDER, WAITING, Kind, Recorder, label, spanned
from hpcdl.diag.flight import dump as dump_flight
from hpcdl.diag.session import DiagOptions, DiagSession
from hpcdl.diag.stall import EXIT_STALLED

record = RECORDER.record  # record(kind, t0, t1, arg=0): a finished block of the training thread
record_aside = RECORDER.record_aside  # the same from another thread (a bucket's allreduce)
span = RECORDER.span  # with span(kind, arg=0): ...
begin_step = RECORDER.begin_step
instant = RECORDER.instant  # instant(kind, arg=0): a point event (a signal)

__all__ = [
    "EXIT_STALLED",
    "RECORDER",
    "WAITING",
    "DiagOptions",
    "DiagSession",
    "Kind",
    "Recorder",
    "begin_step",
    "dump_flight",
    "instant",
    "label",
    "record",
    "record_aside",
    "span",
    "spanned",
]
