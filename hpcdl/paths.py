"""nearest_existing: the deepest existing directory entry on a path, for questions about a
path that is not there yet (its file system's free space, whether it can be created)."""

from __future__ import annotations

from pathlib import Path


def nearest_existing(path: str | Path) -> Path:
    """The path itself when it exists, else its nearest existing ancestor (absolute)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path
