"""Python side of the files the stager shares: status map, progress cursors, hit counters.

Byte layouts (little-endian) are documented in docs/staging.md and mirror staging/src/status_map.h.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import time
from pathlib import Path

PENDING, COPYING, READY, FAILED, EVICTED = range(5)
STATE_NAMES = ("PENDING", "COPYING", "READY", "FAILED", "EVICTED")
RUN_STARTING, RUN_RUNNING, RUN_DONE, RUN_STOPPED = range(4)
FLAG_NOSPACE, FLAG_CAPACITY_FULL = 1, 2

STATUS_MAGIC = b"HPCDLSTA"
STATUS_HEADER = 256
_FIELDS = {  # name: (offset, struct format)
    "version": (8, "<I"),
    "files": (16, "<Q"),
    "plan_hash": (24, "<Q"),
    "fingerprint": (32, "<Q"),
    "pid": (40, "<q"),
    "heartbeat_ns": (48, "<q"),
    "files_staged": (56, "<Q"),
    "bytes_staged": (64, "<Q"),
    "failures": (72, "<Q"),
    "evictions": (80, "<Q"),
    "files_reused": (88, "<Q"),
    "bytes_resident": (96, "<Q"),
    "capacity": (104, "<Q"),
    "run_state": (112, "<I"),
    "flags": (116, "<I"),
    "plan_entries": (120, "<Q"),
    "plan_ready": (128, "<Q"),
    "bytes_reused": (136, "<Q"),
}

PROGRESS_MAGIC = b"HPCDLPRG"
PROGRESS_HEADER = PROGRESS_SLOT = 64
COUNTERS_MAGIC = b"HPCDLCNT"
COUNTER_SLOTS = 64  # per local rank: one per process (rank + loader workers)
COUNTER_SLOT = 32  # pid, hits, misses, spare (int64 each)


class StatusView:
    """Read-only view of <stage_dir>/.hpcdl/status (maps it on first use)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._map: mmap.mmap | None = None

    def open(self) -> bool:
        """Map the file if it exists and is complete; True when mapped."""
        if self._map is not None:
            return True
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < STATUS_HEADER:
                    return False
                m = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
        except OSError:
            return False
        if m[:8] != STATUS_MAGIC:
            m.close()
            return False
        self._map = m
        return True

    def field(self, name: str) -> int:
        offset, fmt = _FIELDS[name]
        return struct.unpack_from(fmt, self._map, offset)[0] if self.open() else 0

    def header(self) -> dict[str, int]:
        return {name: self.field(name) for name in _FIELDS}

    def state(self, file_id: int) -> int:
        if not self.open() or STATUS_HEADER + file_id >= len(self._map):
            return PENDING
        return self._map[STATUS_HEADER + file_id]

    def states(self) -> bytes:
        return bytes(self._map[STATUS_HEADER:]) if self.open() else b""

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None


def stager_alive(view: StatusView, timeout_s: float = 5.0) -> bool:
    """True while the stager's pid exists and its heartbeat is younger than timeout_s."""
    if not view.open():
        return False
    if view.field("run_state") == RUN_STOPPED or not _pid_exists(view.field("pid")):
        return False
    age = time.time_ns() - view.field("heartbeat_ns")
    return age < timeout_s * 1e9


def _atomic_create(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


class ProgressFile:
    """<stage_dir>/.hpcdl/progress: one cursor per local rank (epoch*steps_per_epoch + steps)."""

    def __init__(self, path: str | Path, ranks: int):
        self.path = Path(path)
        self.ranks = ranks
        self._map: mmap.mmap | None = None

    @classmethod
    def create(cls, path: str | Path, ranks: int) -> ProgressFile:
        header = PROGRESS_MAGIC + struct.pack("<II", 1, ranks)
        header += b"\0" * (PROGRESS_HEADER - len(header))
        slots = b"".join(struct.pack("<q", -1) + b"\0" * (PROGRESS_SLOT - 8) for _ in range(ranks))
        _atomic_create(Path(path), header + slots)
        return cls(path, ranks)

    def _mapped(self) -> mmap.mmap:
        if self._map is None:
            with open(self.path, "r+b") as f:
                self._map = mmap.mmap(f.fileno(), 0)
        return self._map

    def set(self, local_rank: int, position: int) -> None:
        # One aligned 8-byte store: the stager never reads a torn cursor.
        struct.pack_into(
            "<q", self._mapped(), PROGRESS_HEADER + local_rank * PROGRESS_SLOT, position
        )

    def get(self, local_rank: int) -> int:
        offset = PROGRESS_HEADER + local_rank * PROGRESS_SLOT
        return struct.unpack_from("<q", self._mapped(), offset)[0]

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None


class CounterFile:
    """<stage_dir>/.hpcdl/counters: hits/misses per local rank, one slot per process.

    Each process (a rank or one of its loader workers) claims a slot once, under flock, and is
    then its only writer, so increments need no atomics and survive worker processes.
    """

    def __init__(self, path: str | Path, ranks: int):
        self.path = Path(path)
        self.ranks = ranks
        self._map: mmap.mmap | None = None
        self._slot: int | None = None
        self._pid = -1

    @classmethod
    def create(cls, path: str | Path, ranks: int) -> CounterFile:
        header = COUNTERS_MAGIC + struct.pack("<II", 1, ranks) + b"\0" * 48
        _atomic_create(Path(path), header + b"\0" * (ranks * COUNTER_SLOTS * COUNTER_SLOT))
        return cls(path, ranks)

    def _mapped(self) -> mmap.mmap:
        if self._map is None or self._pid != os.getpid():
            with open(self.path, "r+b") as f:
                self._map = mmap.mmap(f.fileno(), 0)
            self._pid = os.getpid()
            self._slot = None
        return self._map

    def _offset(self, local_rank: int, slot: int) -> int:
        return 64 + (local_rank * COUNTER_SLOTS + slot) * COUNTER_SLOT

    def _claim(self, local_rank: int) -> int | None:
        m = self._mapped()
        pid = os.getpid()
        with open(self.path, "r+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            free = None
            for slot in range(COUNTER_SLOTS):
                owner = struct.unpack_from("<q", m, self._offset(local_rank, slot))[0]
                if owner == pid:
                    return slot
                if free is None and owner == 0:
                    free = slot
            if free is None:  # all taken: reuse the slot of a process that has exited
                for slot in range(COUNTER_SLOTS):
                    owner = struct.unpack_from("<q", m, self._offset(local_rank, slot))[0]
                    if not _pid_exists(owner):
                        free = slot
                        break
            if free is not None:
                struct.pack_into("<q", m, self._offset(local_rank, free), pid)
            return free

    def add(self, local_rank: int, hits: int, misses: int) -> None:
        m = self._mapped()
        if self._slot is None:
            self._slot = self._claim(local_rank)
            if self._slot is None:
                return
        offset = self._offset(local_rank, self._slot)
        h, mi = struct.unpack_from("<qq", m, offset + 8)
        struct.pack_into("<qq", m, offset + 8, h + hits, mi + misses)

    def totals(self, local_rank: int) -> tuple[int, int]:
        m = self._mapped()
        hits = misses = 0
        for slot in range(COUNTER_SLOTS):
            h, mi = struct.unpack_from("<qq", m, self._offset(local_rank, slot) + 8)
            hits, misses = hits + h, misses + mi
        return hits, misses

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None


def _pid_exists(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
