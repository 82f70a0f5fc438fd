"""The stager's flags as a user gives them (--stage-threads, --stage-capacity), checked where a
command starts, before anything is created.

hpcdl-stage owns the ranges (staging/src/main.cpp, read_option): --threads 1..1024, and
--capacity a byte count its unsigned 64-bit integer holds. A value outside them used to pass the
Python checks and stop the stager after the session was made: its usage text and a run that read
everything from the file system, or a traceback with a stage dir left behind. hpcdl.train
(config.validate), hpcdl.stage and its dry run check them here, with the same words; the
session resolves a percentage with parse_capacity. tests/test_stage_flags.py starts the stager
at both ends of each range, so that the two sides agree.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal

MAX_THREADS = 1024  # hpcdl-stage --threads
MAX_CAPACITY = 2**64 - 1  # hpcdl-stage --capacity, an unsigned long long
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
# 200G, 200Gi, 200GiB, 200GB (binary units all), 1.5T, 123 (bytes), 123B, 80%
_CAPACITY = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(?:([KMGT])i?B?|B|(%))?\s*")


def stage_threads_error(threads: int) -> str | None:
    """The error for --stage-threads outside the stager's range, else None."""
    if 1 <= threads <= MAX_THREADS:
        return None
    return f"--stage-threads must be 1..{MAX_THREADS} (the stager's copy threads), got {threads}"


@dataclass(frozen=True)
class Capacity:
    """What --stage-capacity asks for: `nbytes`, or `percent` of the stage dir's free space."""

    nbytes: int = 0
    percent: Decimal | None = None

    def resolve(self, free: int) -> int:
        """Bytes, given the stage dir's `free` bytes at start."""
        return self.nbytes if self.percent is None else int(free * self.percent / 100)


def parse_capacity_flag(value: str | int) -> Capacity:
    """--stage-capacity as a Capacity; ValueError naming the flag where it is no capacity the
    stager takes."""
    if isinstance(value, int):
        number, unit, percent = Decimal(value), None, None
    else:
        m = _CAPACITY.fullmatch(value)
        if not m:
            raise ValueError(
                "--stage-capacity must be bytes (e.g. 200G) or a percentage (e.g. 80%), "
                f"got {value!r}"
            )
        number, unit, percent = Decimal(m.group(1)), m.group(2), m.group(3)
    if percent:
        if number > 100:
            raise ValueError(f"--stage-capacity {value}: a percentage must be at most 100%")
        return Capacity(percent=number)
    nbytes = int(number * _UNITS[unit or ""])
    if not 0 <= nbytes <= MAX_CAPACITY:
        raise ValueError(
            f"--stage-capacity {value} is outside what the stager takes: 0 to {MAX_CAPACITY} "
            "bytes (16 EiB); give bytes such as 200G, or a percentage such as 80%"
        )
    return Capacity(nbytes)


def stage_flags_error(threads: int | None, capacity: str | int | None) -> str | None:
    """The first error of --stage-threads and --stage-capacity (None: not given), else None."""
    error = None if threads is None else stage_threads_error(threads)
    if error is None and capacity is not None:
        try:
            parse_capacity_flag(capacity)
        except ValueError as exc:
            error = str(exc)
    return error
