"""Test helper: a slow, read-only FUSE view of a directory (tools.bench.slowfs), or one skip.

    with slow_mount(src, tmp_path / "pfs", latency_ms=2) as pfs:   # pfs.mountpoint, pfs.stats()
        ...

The mount ends with the `with` block (and with the test process, if it dies): no mount is left.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tools.bench.slowfs import SlowFSOptions, SlowMount, mounted, unavailable


@functools.cache
def _why_not() -> str | None:
    return unavailable()


def require_fuse() -> None:
    """Skip the test, with the one reason, where a FUSE file system cannot be mounted."""
    reason = _why_not()
    if reason:
        pytest.skip(reason)


@contextmanager
def slow_mount(
    source: Path, mountpoint: Path, latency_ms: float = 1.0, mbps: float = 0.0
) -> Iterator[SlowMount]:
    """source mounted read-only on mountpoint (created), each open paying latency_ms."""
    require_fuse()
    mountpoint.mkdir(parents=True, exist_ok=True)
    with mounted(source, mountpoint, SlowFSOptions(latency_ms, mbps, count_openers=True)) as mount:
        yield mount
