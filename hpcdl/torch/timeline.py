"""Horovod's timeline API over hpcdl's: `hvd.start_timeline(path)` ... `hvd.stop_timeline()`.

Horovod writes a chrome://tracing file of every tensor's phases from its coordinator; hpcdl's
timeline (hpcdl.diag, docs/diagnose.md) writes the same format with one track per rank: each
DistributedOptimizer bucket's allreduce (its bytes, on the communication thread's track), the
Loader's data waits, and whatever the script records with hpcdl.diag. Every rank calls both
functions (they are collective, like hvd.init); each rank buffers its own events and rank 0
merges them into `file_path` at stop_timeline() or hvd.shutdown(), on one clock aligned at start.
`mark_cycles` is accepted and ignored: there is no background cycle to mark.
"""

from __future__ import annotations

from hpcdl import diag
from hpcdl.torch import process

_session: diag.DiagSession | None = None


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Begin recording a Chrome trace to file_path (collective; ValueError if one records)."""
    global _session
    if _session is not None:
        raise ValueError(
            f"a timeline is already recording to {_session.options.timeline}: "
            "call hvd.stop_timeline() first"
        )
    world = process.state().world
    options = diag.DiagOptions(stall_warning=None, timeline=str(file_path), quiet=True)
    _session = diag.DiagSession.open(world.comm, world.node_comm, options, world.node_index)
    process.AT_SHUTDOWN.append(stop_timeline)


def stop_timeline() -> None:
    """Stop recording; rank 0 writes the merged trace (collective; nothing if none records)."""
    global _session
    session, _session = _session, None
    if session is not None:
        if stop_timeline in process.AT_SHUTDOWN:
            process.AT_SHUTDOWN.remove(stop_timeline)
        session.close()
