"""`bench calibrate`'s scratch space in --stage-dir: the only place it writes.

A stage dir that does not exist yet is made as hpcdl.train makes it (mode 0700, with its
missing parents) and removed again with them afterwards (rmdir: only while empty, so nothing
another process put there goes); each measurement works in a temporary directory of its own
inside it, removed with everything in it (shutil.rmtree, which does not follow symlinks).
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def stage_dir_made(path: Path) -> Iterator[None]:
    """path exists while the block runs; the directories made for it are removed after."""
    missing = []
    while not path.exists() and not path.is_symlink():
        missing.append(path)
        path = path.parent
    made = []
    try:
        for directory in reversed(missing):
            directory.mkdir(mode=0o700)
            made.append(directory)
        yield
    finally:
        for directory in reversed(made):
            with contextlib.suppress(OSError):
                directory.rmdir()


@contextlib.contextmanager
def scratch_dir(stage_dir: Path, prefix: str) -> Iterator[Path]:
    """A temporary directory inside stage_dir (made if missing), removed after the block."""
    with stage_dir_made(stage_dir), tempfile.TemporaryDirectory(prefix=prefix, dir=stage_dir) as d:
        yield Path(d)
