"""Emulated parallel file system for tests and benchmarks on one machine.

HPCDL_STAGE_EMULATE_PFS="latency_ms=2,mbps=500" adds a latency to every open of a file on the
PFS and caps the bandwidth of reads from it, in loader workers (image files, HDF5 shards) and
in the stager's copies alike; reads of staged local copies are not slowed. This is an emulation
of a slow PFS, not a model of one: the cap is per process (aggregate over its threads), only
hpcdl's own code honours it, and the stager leaves its production copy path for it. Unit tests
only: benchmarks and the read-only data set tests use a real slow file system that every reader
pays for, `tools.bench.slowfs` (FUSE).
"""

from __future__ import annotations

import io
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

ENV = "HPCDL_STAGE_EMULATE_PFS"


@dataclass(frozen=True)
class PfsEmulation:
    latency_ms: float = 0.0
    mbps: float = 0.0

    @property
    def active(self) -> bool:
        return self.latency_ms > 0 or self.mbps > 0

    @classmethod
    def parse(cls, spec: str) -> PfsEmulation:
        values = {"latency_ms": 0.0, "mbps": 0.0}
        for item in filter(None, (s.strip() for s in spec.split(","))):
            key, sep, value = item.partition("=")
            if key not in values or not sep:
                raise ValueError(f"{ENV}: bad item {item!r} (expected latency_ms=X,mbps=Y)")
            try:
                values[key] = float(value)
            except ValueError:
                raise ValueError(f"{ENV}: {key} must be a number, got {value!r}") from None
            if values[key] < 0:
                raise ValueError(f"{ENV}: {key} must be >= 0, got {value!r}")
        return cls(**values)

    @classmethod
    def from_env(cls) -> PfsEmulation:
        return cls.parse(os.environ.get(ENV, ""))


class _Throttle:
    """Aggregate bandwidth cap of one process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next_free = 0.0

    def take(self, nbytes: int, mbps: float) -> None:
        with self._lock:
            start = max(time.monotonic(), self._next_free)
            self._next_free = start + nbytes / (mbps * 1e6)
            done = self._next_free
        delay = done - time.monotonic()
        if delay > 0:
            time.sleep(delay)


_throttle = _Throttle()  # per process, like the stager's


def throttle(nbytes: int, emulation: PfsEmulation) -> None:
    """Account nbytes read from the PFS against the emulated bandwidth (no-op when unset)."""
    if emulation.mbps > 0 and nbytes > 0:
        _throttle.take(nbytes, emulation.mbps)


def open_latency(emulation: PfsEmulation) -> None:
    """The emulated cost of opening a file on the PFS (no-op when unset)."""
    if emulation.latency_ms > 0:
        time.sleep(emulation.latency_ms / 1000.0)


class _ThrottledReader(io.RawIOBase):
    def __init__(self, raw: BinaryIO, mbps: float):
        self._raw = raw
        self._mbps = mbps

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return self._raw.seekable()

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._raw.seek(offset, whence)

    def tell(self) -> int:
        return self._raw.tell()

    def readinto(self, b) -> int:
        n = self._raw.readinto(b)
        if n:
            _throttle.take(n, self._mbps)
        return n

    def fileno(self) -> int:
        return self._raw.fileno()

    def close(self) -> None:
        self._raw.close()
        super().close()


def open_source(path: str | Path, emulation: PfsEmulation | None = None) -> BinaryIO:
    """Open a file on the PFS for reading ('rb'), with the emulated latency and bandwidth if set.

    Use for PFS reads only; local staged copies are opened with plain open().
    """
    emu = PfsEmulation.from_env() if emulation is None else emulation
    if not emu.active:
        return open(path, "rb")  # noqa: SIM115 (returned to the caller)
    open_latency(emu)
    raw = open(path, "rb", buffering=0)  # noqa: SIM115 (returned to the caller)
    if emu.mbps <= 0:
        return io.BufferedReader(raw)
    return io.BufferedReader(_ThrottledReader(raw, emu.mbps))
