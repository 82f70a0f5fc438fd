"""A run's diagnostics: the heartbeat table, the stall inspector, the timeline, the flight plan.

DiagSession.open (collective, at start-up) aligns the clocks, maps the node's heartbeat table,
binds this rank's slot to it, tells the flight recorder where and as whom to dump, and starts
one daemon thread that runs the stall inspector every POLL_S and drains the ring into the
timeline buffer every DRAIN_S. close() (every rank together) stops the thread and, with
--timeline, has rank 0 merge the buffers into the trace file. abandon() (this rank leaves
alone) only stops the thread: no MPI.

The communicators are passed in: mpi4py's, or anything with their Get_rank, Get_size, bcast,
allgather and Barrier (hpcdl.torch's stand-in over torch.distributed; its jobs end a stall
shutdown with os._exit(5) on every waiting rank, and ask no other node). This package imports
nothing of hpcdl.comm.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcdl import messages
from hpcdl.diag import flight, heartbeat, timeline
from hpcdl.diag.events import PID, RECORDER, Recorder
from hpcdl.diag.remote import NodeQuestions
from hpcdl.diag.stall import POLL_S, StallInspector
from hpcdl.mpi_errors import lost_ranks
from hpcdl.mpi_threads import thread_multiple


@dataclass(frozen=True)
class DiagOptions:
    stall_warning: float | None = 60.0  # seconds in a wait before the stall line; None: off
    stall_shutdown: float | None = None  # seconds more before the job ends (exit 5); None: never
    timeline: str | None = None  # the Chrome trace file to write at the end
    run_dir: str | None = None  # where flight records go (flight/rank-R.json); None: nowhere
    quiet: bool = False  # rank 0 does not say where the timeline went


class DiagSession:
    """This rank's diagnostics for one run; see the module notes."""

    def __init__(self, comm: Any, options: DiagOptions, recorder: Recorder = RECORDER) -> None:
        self.comm, self.options, self.recorder = comm, options, recorder
        self.table: heartbeat.HeartbeatTable | None = None
        self.inspector: StallInspector | None = None
        self.writer: timeline.TimelineWriter | None = None
        self.remote: NodeQuestions | None = None  # other nodes' heartbeats, on a stall
        self._samplers: list[tuple[str, Callable[[], dict[str, int]]]] = []
        self._new_sampler = False  # a sampler was added since the last drain
        self.t_zero = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hpcdl-diag", daemon=True)

    @classmethod
    def open(cls, comm: Any, node_comm: Any, options: DiagOptions, node: int = 0) -> DiagSession:
        """Start this rank's diagnostics; collective over comm and node_comm."""
        session = cls(comm, options)
        rank, host = comm.Get_rank(), socket.gethostname()
        if options.timeline:
            session.recorder.resize(timeline.TIMELINE_EVENTS)
        session.recorder.slot[PID] = os.getpid()
        run_id = comm.bcast(time.time(), root=0)
        flight.PLAN.directory = Path(options.run_dir) if options.run_dir else None
        flight.PLAN.rank, flight.PLAN.world_size, flight.PLAN.run_id = rank, comm.Get_size(), run_id
        flight.PLAN.dumped = False  # a new run (the survivors', after a recovery) records its end
        try:
            session.table = heartbeat.open_on_node(node_comm)
        except OSError as exc:
            messages.warn(f"stall inspector off: cannot share heartbeats on the node ({exc})")
        if session.table is not None:
            session.recorder.bind_slot(session.table.rows[node_comm.Get_rank()])
        node_ranks = tuple(node_comm.allgather(rank))
        every = {n: (h, ranks) for n, h, ranks in comm.allgather((node, host, node_ranks))}
        nodes = [every[n] for n in sorted(every)]
        every_table = all(comm.allgather(session.table is not None))  # the same on every rank
        if every_table and options.stall_warning and len(nodes) > 1 and thread_multiple(comm):
            session.remote = NodeQuestions(comm, nodes, node, session.table)  # collective: Dup
        if session.table is not None and options.stall_warning:
            session.inspector = StallInspector(
                session.table, node_ranks, node_comm.Get_rank(), host, options.stall_warning,
                options.stall_shutdown, getattr(comm, "Abort", os._exit), remote=session.remote,
            )  # fmt: skip
        comm.Barrier()
        comm.Barrier()  # the clock: every rank leaves this barrier at about the same instant
        session.t_zero = time.perf_counter()
        if options.timeline:
            who = {"rank": rank, "host": host, "node": node, "world_size": comm.Get_size()}
            try:
                session.writer = timeline.TimelineWriter(options.timeline, who, session.t_zero)
            except OSError as exc:  # training goes on; this rank's track is missing
                messages.warn(f"--timeline {options.timeline}: {exc.strerror or exc}; no timeline")
        session._thread.start()
        return session

    def add_counters(self, name: str, sample: Callable[[], dict[str, int] | None]) -> None:
        """With --timeline: sample() (cumulative counts, quick, thread-safe; None once its
        owner closed) every DRAIN_S, drawn as rates on this node's track (a node leader's
        stager)."""
        self._samplers.append((name, sample))
        self._new_sampler = True  # sampled at once: a rate needs two samples, however short the run

    def _run(self) -> None:
        drained = time.perf_counter()
        while not self._stop.wait(POLL_S):
            now = time.perf_counter()
            if self.remote is not None:
                try:
                    self.remote.serve()
                except Exception as exc:
                    if not lost_ranks(exc):
                        raise
                    self.remote = None  # a rank of its communicator is gone: stop answering
                    # (--on-node-loss continue opens the new run's session on the survivors)
            if self.inspector is not None:
                self.inspector.check(now)
            due = now - drained >= timeline.DRAIN_S or self._new_sampler
            if self.writer is not None and due:
                self._drain(now)
                drained = now

    def _drain(self, now: float) -> None:
        self._new_sampler = False
        self.writer.drain()
        for name, sample in list(self._samplers):
            try:
                values = sample()
            except (OSError, ValueError):  # its owner closed it (a run's last sample)
                continue
            if values is not None:
                self.writer.sample(name, values, now)

    def _stop_thread(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * POLL_S + 5)

    def close(self) -> None:
        """Every rank together: stop the thread, write the timeline, unmap the table."""
        self._stop_thread()
        if self.writer is not None:
            self._drain(time.perf_counter())  # the counters' last sample
            self.writer.close()
        if self.remote is not None:
            self.remote.close()
        self.comm.Barrier()
        if self.writer is not None and self.comm.Get_rank() == 0:
            self._merge(self.options.timeline)
        self._unbind()

    def _merge(self, trace: str) -> None:
        """Rank 0: the ranks' buffers into the trace, then remove them (a failed merge leaves
        them for `python -m hpcdl.report timeline`)."""
        try:
            ranks = timeline.merge(timeline.parts_dir(trace), trace)
        except (OSError, ValueError) as exc:
            parts = timeline.parts_dir(trace)
            messages.warn(
                f"--timeline {trace} not written ({exc}); the ranks' buffers stay in {parts}: "
                "python -m hpcdl.report timeline merges them"
            )
            return
        timeline.remove_parts(trace, ranks)
        if not self.options.quiet:
            print(f"hpcdl: timeline of {ranks} rank(s) in {trace}", flush=True)

    def abandon(self) -> None:
        """This rank alone (it failed): stop the thread; no MPI."""
        self._stop_thread()
        if self.writer is not None:
            self.writer.close()

    def _unbind(self) -> None:
        self.recorder.slot = self.recorder.slot.copy()  # the table's memory goes next
        if self.table is not None:
            self.table.close()
            self.table = None
