"""The node's heartbeat table: every local rank's slot (hpcdl.diag.events) in one shared file.

The node's first rank creates a file of local_size x SLOT_FIELDS float64 in /dev/shm (or
$HPCDL_SHM_DIR), every local rank maps it, and once all have, the creator unlinks it: the
mappings live on, and nothing is left on the node however the job ends (SIGKILL included).
A rank writes only its own row; readers take a copy and may see a row half updated, which
costs one poll's accuracy, never a wrong name: the fields are independent floats.
"""

from __future__ import annotations

import mmap
import os
import tempfile
from typing import Any

import numpy as np

from hpcdl.diag.events import ALIVE, LAST_END, LAST_KIND, PID, SINCE, SLOT_FIELDS, STATE, STEP

# A table's rows as ages, comparable across nodes (no clocks compared): the columns.
STEP_NOW, STATE_NOW, SINCE_AGE, ALIVE_AGE, LAST, LAST_AGE, PROCESS = range(7)
AGE_FIELDS = 7


def shm_dir() -> str:
    return os.environ.get("HPCDL_SHM_DIR", "/dev/shm")


class HeartbeatTable:
    """The mapped table; rows by local rank. Make it with `open_on_node` (collective)."""

    def __init__(self, fd: int, rows: int) -> None:
        size = rows * SLOT_FIELDS * 8
        self._map = mmap.mmap(fd, size)
        self.rows = np.frombuffer(self._map, np.float64).reshape(rows, SLOT_FIELDS)

    def snapshot(self) -> np.ndarray:
        """A copy of every row: (local_size, SLOT_FIELDS) float64."""
        return self.rows.copy()

    def close(self) -> None:
        self.rows = np.zeros_like(self.rows)  # drop the view before the map
        try:
            self._map.close()
        except BufferError:  # a view handed out earlier is still alive; the process keeps it
            pass


def open_on_node(node_comm: Any) -> HeartbeatTable:
    """The node's table, mapped by every rank of node_comm (mpi4py); collective."""
    rows = node_comm.Get_size()
    path, error = None, None
    if node_comm.Get_rank() == 0:
        try:
            fd, path = tempfile.mkstemp(prefix="hpcdl-heartbeat-", dir=shm_dir())
            os.ftruncate(fd, rows * SLOT_FIELDS * 8)
            os.close(fd)
        except OSError as exc:
            error = f"{shm_dir()}: {exc.strerror or exc}"
    path, error = node_comm.bcast((path, error), root=0)
    if error is not None:
        raise OSError(error)
    fd = os.open(path, os.O_RDWR)
    try:
        table = HeartbeatTable(fd, rows)
    finally:
        os.close(fd)
        node_comm.Barrier()  # every rank has mapped it
        if node_comm.Get_rank() == 0:
            os.unlink(path)
    return table


def ages(rows: np.ndarray, now: float) -> np.ndarray:
    """Heartbeat rows (perf_counter times of this node) as ages: (n, AGE_FIELDS) float64,
    columns STEP_NOW, STATE_NOW, SINCE_AGE (s in the state), ALIVE_AGE (s since the thread's
    stamp), LAST (kind of the last event), LAST_AGE (s since it ended), PROCESS (the kernel's
    state letter of the rank's process as ord(), 0 when unknown: process_state)."""
    out = np.empty((len(rows), AGE_FIELDS))
    out[:, STEP_NOW], out[:, STATE_NOW] = rows[:, STEP], rows[:, STATE]
    out[:, SINCE_AGE], out[:, ALIVE_AGE] = now - rows[:, SINCE], now - rows[:, ALIVE]
    out[:, LAST], out[:, LAST_AGE] = rows[:, LAST_KIND], now - rows[:, LAST_END]
    out[:, PROCESS] = [ord(process_state(int(pid))) for pid in rows[:, PID]]
    return out


def process_state(pid: int) -> str:
    """The kernel's state letter of a process of this node (/proc/PID/stat: R running, S
    sleeping, D uninterruptible I/O, T stopped, Z zombie), "X" when it is gone, "\0" when it
    cannot be known (no pid, no /proc)."""
    if pid <= 0:
        return "\0"
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0][:1] or "\0"
    except FileNotFoundError:
        return "X"
    except (OSError, IndexError):
        return "\0"
