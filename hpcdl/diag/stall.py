"""The stall inspector: a rank that waits too long names the ranks it waits for.

NOTE [naming a stuck rank]
A rank stuck but alive (SIGSTOP, a hung file system call, a deadlocked hook) sends nothing and
answers nothing, so it cannot be asked; the ranks waiting for it must infer it from what it
published before it stopped. Each rank's heartbeat slot (hpcdl.diag.events) says which step it
is in, whether it waits and in what since when, and its last event; the session's daemon
thread (hpcdl.diag.session) stamps the slot's ALIVE field every POLL_S. It calls no MPI (but
MPI_Abort at a shutdown), and the training thread pays only the slot writes of the events it
records anyway: no collective on the hot path.

When this rank has waited in a collective or for its loader for --stall-warning seconds, the
thread reads the node's heartbeat table and names every other rank that has not arrived:
- no ALIVE stamp for STALE_S: its process does not run (stopped, frozen by the kernel);
- alive but not waiting: busy in something that does not end (its last event says what);
- waiting, but at an earlier step: itself held up, or waiting for its loader.
One rank per node prints, the lowest that waits (the others would print the same line); it
says once per stall, and again when the wait ends. Ranks on other nodes are not in the table:
the line names the node-local view only (docs/diagnose.md).

--stall-shutdown S: at warning + S seconds every waiting rank writes its flight record, and the
printing rank ends the job with exit status 5 (EXIT_STALLED) after GRACE_S, time for the
others' records; a waiting rank that does not print ends it GRACE_S later, in case the
printing one cannot.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from hpcdl import messages
from hpcdl.diag import flight
from hpcdl.diag.events import ALIVE, RECORDER, SINCE, STATE, STEP, WAITING, Kind, Recorder, label
from hpcdl.diag.heartbeat import (
    ALIVE_AGE,
    LAST,
    LAST_AGE,
    PROCESS,
    SINCE_AGE,
    STATE_NOW,
    STEP_NOW,
    ages,
)

POLL_S = 0.25  # how often the thread stamps ALIVE and looks at this rank's wait
# No ALIVE stamp for this long: the rank's process does not run. Eight polls: a thread that a
# loaded node delays this long is rarer than a stopped process.
STALE_S = 2.0
GRACE_S = 1.0  # after a shutdown decision, for the other ranks' flight records
EXIT_STALLED = 5  # --stall-shutdown's exit status (docs/reliability.md)
SILENT = {  # why a rank is silent, by its process's state letter (hpcdl.diag.heartbeat)
    "T": " (its process is stopped: SIGSTOP, a debugger)",
    "t": " (its process is stopped by a debugger)",
    "D": " (its process waits in uninterruptible I/O: a hung file system?)",
    "Z": " (its process has exited)",
    "X": " (its process is gone)",
    "\0": " (stopped or frozen?)",
}


class StallInspector:
    """What this rank's diagnostics thread does every POLL_S (NOTE [naming a stuck rank])."""

    def __init__(
        self,
        table: Any,  # hpcdl.diag.heartbeat.HeartbeatTable of this node
        node_ranks: tuple[int, ...],  # world rank of each local rank
        local_rank: int,
        host: str,
        warn_s: float,
        shutdown_s: float | None,
        abort: Callable[[int], None],
        recorder: Recorder = RECORDER,
        remote: Any = None,  # hpcdl.diag.remote.NodeQuestions: other nodes' heartbeats
    ) -> None:
        self.table, self.node_ranks, self.local_rank = table, node_ranks, local_rank
        self.rank, self.host = node_ranks[local_rank], host
        self.warn_s, self.shutdown_s, self.abort = warn_s, shutdown_s, abort
        self.recorder, self.remote = recorder, remote
        self._stall: float | None = None  # SINCE of the wait warned about
        self._stall_step = 0  # the step it happened in
        self._printed = False  # this rank printed the warning of the current stall
        self._ending = False
        self._frozen_wait = -1.0  # SINCE of a wait this process spent partly stopped
        self._cpu = time.process_time()  # this process's CPU seconds at the last check
        recorder.slot[ALIVE] = time.perf_counter()

    def check(self, now: float) -> None:
        """One look: stamp ALIVE, warn of a new stall, say one ended, shut down if asked."""
        slot = self.recorder.slot
        gap, slot[ALIVE] = now - slot[ALIVE], now
        cpu, self._cpu = time.process_time() - self._cpu, time.process_time()
        state, since = int(slot[STATE]), float(slot[SINCE])
        if gap >= STALE_S and cpu < gap / 10:  # stopped, not busy: its wait was no stall
            self._frozen(gap, since)
        waiting = state in WAITING and since != self._frozen_wait
        if self._stall is not None and (not waiting or since != self._stall):
            if self._printed:
                messages.warn(
                    f"stall over: rank {self.rank} waited {now - self._stall:.1f} s in all "
                    f"(step {self._stall_step})"
                )
            self._stall, self._printed = None, False
        if not waiting or now - since < self.warn_s:
            return
        if self._stall is None:
            rows = ages(self.table.snapshot(), now)  # this node's ranks, by local rank
            late = self._late_here(rows)
            if not late and state != Kind.DATA_WAIT:
                if now - since < self.warn_s + STALE_S:
                    return  # a rank that stopped just now shows as silent within STALE_S
                if self.remote is not None and self._reports(rows):
                    late = self._late_elsewhere(rows[self.local_rank])
            self._stall, self._stall_step = since, int(slot[STEP])
            self._printed = self._reports(rows)
            if self._printed:
                messages.warn(self.describe(rows[self.local_rank], late))
            self.recorder.instant(Kind.STALL, int(now - since))
        if self.shutdown_s is not None and now - since >= self.warn_s + self.shutdown_s:
            self._shut_down(now - since)

    def _frozen(self, gap: float, since: float) -> None:
        self._frozen_wait = since
        self.recorder.instant(Kind.FROZEN, int(gap * 1e3))
        messages.warn(
            f"this process (rank {self.rank}) did not run for {gap:.1f} s: stopped (SIGSTOP, a "
            "debugger) or frozen by the system; the other ranks waited for it"
        )

    def _reports(self, rows: np.ndarray) -> bool:
        """This rank prints: no lower local rank is alive and waiting too (rows: ages)."""
        for row in rows[: self.local_rank]:
            if (
                row[ALIVE_AGE] < STALE_S
                and int(row[STATE_NOW]) in WAITING
                and (row[SINCE_AGE] >= self.warn_s / 2)
            ):
                return False
        return True

    def describe(self, mine: np.ndarray, late: list[str]) -> str:
        """The stall line: this rank's wait (mine: its ages row), then the ranks not arrived."""
        step, state = int(mine[STEP_NOW]), int(mine[STATE_NOW])
        line = f"stall: rank {self.rank} has waited {mine[SINCE_AGE]:.1f} s in {label(state)}"
        line += f" (step {step})" if state != Kind.DATA_WAIT else f" for step {step + 1}"
        if late:
            return f"{line}; not arrived: {'; '.join(late)}"
        if state == Kind.DATA_WAIT:
            return f"{line}: its loader holds it up (and the ranks waiting for it)"
        return f"{line}; every rank on this node waits too: the one missing is elsewhere"

    def _late_here(self, rows: np.ndarray) -> list[str]:
        mine = rows[self.local_rank]
        found = [
            late(self.node_ranks[local], self.host, row, mine)
            for local, row in enumerate(rows)
            if local != self.local_rank
        ]
        return [text for text in found if text]

    def _late_elsewhere(self, mine: np.ndarray) -> list[str]:
        """The ranks of other nodes not arrived, from their nodes' answers (hpcdl.diag.remote)."""
        found = []
        for host, ranks, rows in self.remote.ask():
            if rows is None:
                found.append(
                    f"node {host} (ranks {', '.join(map(str, ranks))}) did not answer: every "
                    "process there is stopped, or the link to it is cut"
                )
                continue
            found += [late(rank, host, row, mine) for rank, row in zip(ranks, rows)]
        return [text for text in found if text]

    def _shut_down(self, waited: float) -> None:
        if self._ending:
            return
        self._ending = True
        flight.dump(f"stall shutdown after {waited:.1f} s (--stall-shutdown)", self.recorder)
        if self._printed:
            messages.error(
                f"stalled {waited:.1f} s (--stall-warning {self.warn_s:g} + --stall-shutdown "
                f"{self.shutdown_s:g}): the job ends with exit status {EXIT_STALLED}; resume "
                "with --resume auto from the last checkpoint",
                rank=self.rank,
            )
        time.sleep(GRACE_S if self._printed else 3 * GRACE_S)
        self.abort(EXIT_STALLED)


def late(rank: int, host: str, row: np.ndarray, mine: np.ndarray) -> str | None:
    """Why `rank` (its heartbeat as ages) has not arrived where this rank (mine) waits, or
    None when it waits there too."""
    step, loading = int(mine[STEP_NOW]), int(mine[STATE_NOW]) == Kind.DATA_WAIT
    state, behind = int(row[STATE_NOW]), row[STEP_NOW] < mine[STEP_NOW]
    # a rank waiting for its batch of step N + 1 shows step N until the batch arrives
    behind = behind or (state == Kind.DATA_WAIT and row[STEP_NOW] <= step and not loading)
    if row[ALIVE_AGE] >= STALE_S:
        why = f"no sign of life for {row[ALIVE_AGE]:.1f} s" + SILENT.get(
            chr(int(row[PROCESS])), " (its process runs: busy in code that holds the GIL?)"
        )
    elif state not in WAITING:
        why = "busy, not waiting"
    elif behind:
        why = f"in {label(state)} for {row[SINCE_AGE]:.1f} s at step {int(row[STEP_NOW])}"
    else:
        return None
    last = f", last event {label(row[LAST])} {row[LAST_AGE]:.1f} s ago" if row[LAST] else ""
    return f"rank {rank} on {host}: {why}{last}"
