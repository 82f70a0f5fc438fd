"""Python side of the files the stager shares: status map, progress cursors, hit counters.

hpcdl-stage owns the status map's and the progress file's layouts: Python reads them once per
process from `hpcdl-stage --print-layout` (status_layout()), so offsets and state codes have one
definition, in staging/src/status_map.h. docs/staging.md documents them; the counters file is
Python's alone.
"""

from __future__ import annotations

import fcntl
import functools
import json
import mmap
import os
import struct
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from hpcdl.atomic import write_bytes_atomically
from hpcdl.staging.binary import StagerNotFound, find_stager_binary

COUNTERS_MAGIC = b"HPCDLCNT"
COUNTER_SLOTS = 64  # per local rank: one per process (rank + loader workers)
COUNTER_SLOT = 32  # pid, hits, misses, spare (int64 each)
_FORMATS = {"u32": "<I", "u64": "<Q", "i64": "<q"}


@dataclass(frozen=True)
class StatusLayout:
    """What `hpcdl-stage --print-layout` says about the files it shares with Python."""

    magic: bytes
    version: int
    header_size: int
    fields: dict[str, tuple[int, str]]  # header field -> (offset, struct format)
    file_states: dict[str, int]  # PENDING, COPYING, READY, FAILED, EVICTED -> status byte
    run_states: dict[str, int]  # STARTING, RUNNING, DONE, STOPPED -> run_state
    flags: dict[str, int]  # NOSPACE, CAPACITY_FULL -> bit in flags
    progress: dict  # magic, version, header_size, ranks_offset, slot_size of the progress file


@functools.cache
def status_layout() -> StatusLayout:
    """The layout the installed hpcdl-stage uses (one subprocess per process, then cached)."""
    binary = find_stager_binary()
    out = subprocess.run([str(binary), "--print-layout"], capture_output=True, text=True)
    try:
        raw = json.loads(out.stdout) if out.returncode == 0 else None
    except ValueError:
        raw = None
    if not isinstance(raw, dict):
        raise StagerNotFound(
            f"{binary} --print-layout did not print the status layout (exit {out.returncode}): "
            "it is not this hpcdl's hpcdl-stage; reinstall hpcdl or fix HPCDL_STAGE_BIN"
        )
    status = raw["status"]
    return StatusLayout(
        magic=status["magic"].encode(),
        version=status["version"],
        header_size=status["header_size"],
        fields={k: (v["offset"], _FORMATS[v["type"]]) for k, v in status["fields"].items()},
        file_states=status["file_states"],
        run_states=status["run_states"],
        flags=status["flags"],
        progress=raw["progress"],
    )


def __getattr__(name: str) -> int:
    """READY, RUN_RUNNING, FLAG_NOSPACE, ...: the binary's codes, looked up on first use.

    Only upper-case names ask the binary: the import system probes modules for `__path__` and
    the like, and importing this module must not need a working hpcdl-stage."""
    if not name.isupper():
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    layout = status_layout()
    if name.startswith("RUN_") and name[4:] in layout.run_states:
        return layout.run_states[name[4:]]
    if name.startswith("FLAG_") and name[5:] in layout.flags:
        return layout.flags[name[5:]]
    if name in layout.file_states:
        return layout.file_states[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class StatusView:
    """Read-only view of <stage_dir>/.hpcdl/status (maps it on first use)."""

    def __init__(self, path: str | Path, layout: StatusLayout | None = None):
        self.path = Path(path)
        self.layout = layout or status_layout()  # given: no subprocess (loader workers)
        self._map: mmap.mmap | None = None

    def open(self) -> bool:
        """Map the file if it exists and is complete; True when mapped."""
        if self._map is not None:
            return True
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < self.layout.header_size:
                    return False
                m = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
        except OSError:
            return False
        if m[:8] != self.layout.magic:
            m.close()
            return False
        self._map = m
        return True

    @property
    def mapped(self) -> bool:
        """Whether the file is mapped now (open() maps it; this never tries to)."""
        return self._map is not None

    def field(self, name: str) -> int:
        offset, fmt = self.layout.fields[name]
        return struct.unpack_from(fmt, self._map, offset)[0] if self.open() else 0

    def header(self) -> dict[str, int]:
        return {name: self.field(name) for name in self.layout.fields}

    def state(self, file_id: int) -> int:
        """The status byte of file_id (PENDING while the map is missing)."""
        start = self.layout.header_size
        if not self.open() or start + file_id >= len(self._map):
            return self.layout.file_states["PENDING"]
        return self._map[start + file_id]

    def states(self) -> bytes:
        return bytes(self._map[self.layout.header_size :]) if self.open() else b""

    def run_state(self) -> str:
        """STARTING, RUNNING, DONE or STOPPED (STARTING while the map is missing)."""
        code = self.field("run_state")
        return next((k for k, v in self.layout.run_states.items() if v == code), "STARTING")

    def has_flag(self, name: str) -> bool:
        return bool(self.field("flags") & self.layout.flags[name])

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None


def stager_alive(view: StatusView, timeout_s: float = 5.0) -> bool:
    """True while the stager's pid exists and its heartbeat is younger than timeout_s."""
    if not view.open():
        return False
    if view.run_state() == "STOPPED" or not _pid_exists(view.field("pid")):
        return False
    age = time.time_ns() - view.field("heartbeat_ns")
    return age < timeout_s * 1e9


class ProgressFile:
    """<stage_dir>/.hpcdl/progress: one cursor per local rank (epoch*steps_per_epoch + steps)."""

    def __init__(self, path: str | Path, ranks: int):
        self.path = Path(path)
        self.ranks = ranks
        layout = status_layout().progress
        self.header_size, self.slot_size = layout["header_size"], layout["slot_size"]
        self._map: mmap.mmap | None = None

    @classmethod
    def create(cls, path: str | Path, ranks: int) -> ProgressFile:
        layout = status_layout().progress
        header = bytearray(layout["header_size"])
        header[:8] = layout["magic"].encode()
        struct.pack_into("<I", header, 8, layout["version"])
        struct.pack_into("<I", header, layout["ranks_offset"], ranks)
        slot = struct.pack("<q", -1) + b"\0" * (layout["slot_size"] - 8)
        write_bytes_atomically(path, bytes(header) + slot * ranks)
        return cls(path, ranks)

    def _mapped(self) -> mmap.mmap:
        if self._map is None:
            with open(self.path, "r+b") as f:
                self._map = mmap.mmap(f.fileno(), 0)
        return self._map

    def set(self, local_rank: int, position: int) -> None:
        # One aligned 8-byte store: the stager never reads a torn cursor.
        offset = self.header_size + local_rank * self.slot_size
        struct.pack_into("<q", self._mapped(), offset, position)

    def get(self, local_rank: int) -> int:
        offset = self.header_size + local_rank * self.slot_size
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
        write_bytes_atomically(path, header + b"\0" * (ranks * COUNTER_SLOTS * COUNTER_SLOT))
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
