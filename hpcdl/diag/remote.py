"""Heartbeats of other nodes, asked for only when a stall needs them.

NOTE [asking another node]
The heartbeat table (hpcdl.diag.heartbeat) is shared by the ranks of one node only. When every
rank of this node waits, the one missing is on another node, and its own process may be the
one that does not run. So the question goes to the node, not to the rank: any rank of that
node can read the node's table and answer for all of its ranks, the stuck one included.

Each rank's diagnostics thread keeps one receive posted for a question (ANY_SOURCE, on a
communicator of its own, duplicated at start-up) and tests it every poll; the answer is the
node's table as ages (seconds before now on the answering node: no clocks are compared across
nodes). The asking rank (the one that prints the stall line) asks ASKED_PER_NODE ranks of every
other node and waits at most ANSWER_S for one answer per node, answering questions itself
meanwhile (two nodes may ask each other at once). A node where nobody answers has all its
processes stopped, or its link is cut: the line says so. Nothing here runs on the training
thread, and nothing runs unless a stall has lasted --stall-warning: no collective, no message
on the hot path. Needs MPI_THREAD_MULTIPLE (the thread calls MPI); without it the inspector
keeps to its node.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from hpcdl.diag.heartbeat import AGE_FIELDS, ages

QUESTION, ANSWER = 11, 12  # tags
ASKED_PER_NODE = 2  # a node whose first ranks are all stopped is rare; 2 is cheap
ANSWER_S = 1.0


class NodeQuestions:
    """This rank's side of the questions between nodes (NOTE [asking another node])."""

    def __init__(self, comm: Any, nodes: list[tuple[str, tuple[int, ...]]], node: int,
                 table: Any) -> None:  # fmt: skip
        from mpi4py import MPI  # noqa: PLC0415

        self._mpi = MPI
        self.comm = comm.Dup()  # collective
        self.nodes, self.node, self.table = nodes, node, table
        self._question = np.zeros(1, np.float64)  # the asker's question number
        self._request = self.comm.Irecv(self._question, source=MPI.ANY_SOURCE, tag=QUESTION)
        self._status = MPI.Status()
        self._sends: list[Any] = []  # kept until complete: MPI may still read them
        self._asked = 0

    def serve(self) -> None:
        """Answer the questions that have arrived (diagnostics thread)."""
        while self._request.Test(self._status):
            asker = self._status.Get_source()
            answer = np.concatenate(
                [self._question, ages(self.table.snapshot(), time.perf_counter()).ravel()]
            )
            self._sends.append(self.comm.Isend(answer, dest=asker, tag=ANSWER))
            self._request = self.comm.Irecv(self._question, source=self._mpi.ANY_SOURCE,
                                            tag=QUESTION)  # fmt: skip
        self._sends = [s for s in self._sends if not s.Test()]

    def ask(self) -> list[tuple[str, tuple[int, ...], np.ndarray | None]]:
        """Every other node's (host, ranks, ages or None when nobody there answered)."""
        self._asked += 1
        number = np.array([float(self._asked)])
        pending: dict[int, list[list]] = {}  # node -> [[request, box, rank], ...]
        for index, (_, ranks) in enumerate(self.nodes):
            if index == self.node:
                continue
            pending[index] = []
            for rank in ranks[:ASKED_PER_NODE]:
                self._sends.append(self.comm.Isend(number, dest=rank, tag=QUESTION))
                box = np.zeros(1 + len(ranks) * AGE_FIELDS)
                request = self.comm.Irecv(box, source=rank, tag=ANSWER)
                pending[index].append([request, box, rank])
        answers: dict[int, np.ndarray] = {}
        deadline = time.monotonic() + ANSWER_S
        while len(answers) < len(pending) and time.monotonic() < deadline:
            self.serve()
            for index, posted in pending.items():
                for entry in posted:
                    request, box, rank = entry
                    if index in answers or not request.Test():
                        continue
                    if box[0] == number[0]:
                        answers[index] = box[1:].reshape(-1, AGE_FIELDS)
                    else:  # a late answer to an earlier question: wait for this one's
                        entry[0] = self.comm.Irecv(box, source=rank, tag=ANSWER)
            time.sleep(0.005)
        for posted in pending.values():  # answers still to come are dropped
            for request, _, _ in posted:
                if not request.Test():
                    request.Cancel()
                    request.Wait()
        return [(self.nodes[i][0], self.nodes[i][1], answers.get(i)) for i in pending]

    def close(self) -> None:
        """Every rank together: no question is asked any more."""
        self._request.Cancel()
        self._request.Wait()
        self.comm.Barrier()  # nobody sends a question after this
        self.comm.Free()
