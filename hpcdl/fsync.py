"""fsync_path: make a file's contents, or a directory's entries (a rename), durable on disk."""

from __future__ import annotations

import os


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or directory by path (opened read-only just for it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
