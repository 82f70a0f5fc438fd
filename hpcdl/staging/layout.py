"""The stage dir's layout, its lock and which sessions are alive: what ownership and trash share.

The names of hpcdl's files in a stage dir (StageDir, SessionDir; hpcdl-stage keeps the same
names in C++), the flock that every join, leave and removal holds (locked), the liveness of a
session (its owner file names a process that still runs with the same start time), the exact
removal of what a manifest lists (remove_created), and the last step of every clean-up
(tidy_if_unused). hpcdl.staging.ownership (a job's lease) and hpcdl.staging.trash (removal off
the job's path) both build on this module; it imports neither. The rules are NOTE [stage dir
ownership] in hpcdl/staging/ownership.py.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from hpcdl.staging.manifest import ManifestRecord

META = ".hpcdl"
SESSIONS = "sessions"
OWNER = "owner"
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class SessionDir:
    """One job's control files, <stage>/.hpcdl/sessions/<name>/ (formats in docs/staging.md).

    The one Python owner of their names; hpcdl-stage keeps the same names in C++."""

    path: Path

    @property
    def plan(self) -> Path:
        return self.path / "plan"

    @property
    def status(self) -> Path:
        return self.path / "status"

    @property
    def progress(self) -> Path:
        return self.path / "progress"

    @property
    def counters(self) -> Path:
        return self.path / "counters"

    @property
    def owner(self) -> Path:
        return self.path / OWNER


@dataclass(frozen=True)
class StageDir:
    """What hpcdl keeps in a stage dir: <root>/.hpcdl/{manifest,created,lock,sessions/}."""

    root: Path

    @property
    def meta(self) -> Path:
        return self.root / META

    @property
    def manifest(self) -> Path:
        return self.meta / "manifest"

    @property
    def created(self) -> Path:
        return self.meta / "created"

    @property
    def lock(self) -> Path:
        return self.meta / "lock"

    @property
    def sessions(self) -> Path:
        return self.meta / SESSIONS

    def session(self, name: str) -> SessionDir:
        return SessionDir(self.sessions / name)


def tidy_if_unused(stage: Path) -> None:
    """Remove hpcdl's metadata, and the stage dir if hpcdl created it, when no live session,
    manifest or trash entry is left (the last job or remover out)."""
    layout = StageDir(stage)
    with locked_unless_tidied(stage) as held:
        if not held:
            return
        sessions = layout.sessions
        if any(session_alive(sessions / s) for s in list_dir(sessions)):
            return
        rmdir_quietly(layout.meta / "trash")
        if os.path.lexists(layout.manifest) or os.path.lexists(layout.meta / "trash"):
            return
        for name in list_dir(sessions):
            remove_session(sessions, name)
        rmdir_quietly(sessions)
        created = read_text(layout.created)
        for path in (layout.created, layout.lock):
            unlink_quietly(path)
    rmdir_quietly(layout.meta)
    if created == inode_text(stage):
        rmdir_quietly(stage)


def remove_created(stage_dir: Path, records: list[ManifestRecord]) -> int:
    """Remove the files, then the empty directories, that `records` say a stager created.

    An entry is removed only while its inode is the recorded one, reached through directory
    descriptors that never follow a symlink. Returns how many files were removed."""
    files: dict[str, set[tuple[int, int]]] = {}
    dirs: dict[str, set[tuple[int, int]]] = {}
    for r in records:
        (files if r.kind == "f" else dirs).setdefault(r.dest, set()).add((r.copy_ino, r.copy_dev))
    removed = 0
    with _DirCache(stage_dir) as tree:
        for dest, ids in files.items():
            removed += tree.remove(dest, ids, stat.S_ISREG, os.unlink)
        for dest in sorted(dirs, key=lambda d: d.count("/"), reverse=True):
            tree.forget(dest)
            tree.remove(dest, dirs[dest], stat.S_ISDIR, os.rmdir)
    return removed


class _DirCache:
    """Directory descriptors under a root, each opened from its parent with O_NOFOLLOW."""

    def __init__(self, root: Path):
        self.root = root
        self.fds: dict[str, int | None] = {}

    def __enter__(self) -> _DirCache:
        try:
            self.fds[""] = os.open(self.root, DIR_FLAGS)
        except OSError:
            self.fds[""] = None
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in self.fds.values():
            if fd is not None:
                os.close(fd)

    def open(self, rel: str) -> int | None:
        if rel not in self.fds:
            parent, _, name = rel.rpartition("/")
            pfd = self.open(parent)
            try:
                self.fds[rel] = None if pfd is None else os.open(name, DIR_FLAGS, dir_fd=pfd)
            except OSError:
                self.fds[rel] = None  # gone, or a symlink / non-directory: not ours to enter
        return self.fds[rel]

    def forget(self, rel: str) -> None:
        fd = self.fds.pop(rel, None)
        if fd is not None:
            os.close(fd)

    def remove(self, rel: str, ids: set[tuple[int, int]], kind, unlink) -> int:
        parent, _, name = rel.rpartition("/")
        pfd = self.open(parent)
        if pfd is None:
            return 0
        try:
            st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
            if not kind(st.st_mode) or (st.st_ino, st.st_dev) not in ids:
                return 0
            unlink(name, dir_fd=pfd)
        except OSError:
            return 0  # gone meanwhile, or a directory that is not empty
        return 1


# ------------------------------------------------------------------ sessions and the lock


@contextlib.contextmanager
def locked(stage: Path) -> Iterator[None]:
    """Hold <stage>/.hpcdl/lock; retried when a job that cleaned up removed the lock file."""
    layout = StageDir(stage)
    while True:
        make_dir(layout.meta)
        fd = _lock_if_current(layout, os.O_CREAT)
        if fd is not None:
            break
    try:
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def locked_unless_tidied(stage: Path) -> Iterator[bool]:
    """Hold <stage>/.hpcdl/lock and yield True; yield False without creating anything when the
    lock file is gone, or goes while this waits for it: another tidy removed hpcdl's metadata
    (and maybe the stage dir) and finishes the job itself (tidy_if_unused)."""
    fd = _lock_if_current(StageDir(stage), 0)
    try:
        yield fd is not None
    finally:
        if fd is not None:
            os.close(fd)


def _lock_if_current(layout: StageDir, create: int) -> int | None:
    """flock the lock file; its descriptor while that file is still the one at the lock's path,
    else None (a tidy unlinked it while this waited)."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | create
    try:
        fd = os.open(layout.lock, flags, 0o600)
    except FileNotFoundError:
        if create:
            raise
        return None
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        if os.stat(layout.lock, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
            return fd
    except FileNotFoundError:
        pass
    os.close(fd)
    return None


def process_start(pid: int) -> str | None:
    """Start time of a process (clock ticks since boot), None when it does not exist."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rpartition(")")[2].split()[19]


def session_alive(session: Path) -> bool:
    lines = (read_text(SessionDir(session).owner) or "").split("\n")
    if len(lines) < 3 or not lines[1].isdigit():
        return False
    if lines[0] != socket.gethostname():
        return True  # another host's process: cannot be checked, so it keeps its reference
    return process_start(int(lines[1])) == lines[2]


def remove_session(sessions: Path, name: str, keep_status: bool = False) -> None:
    """Remove one session directory: the files directly in it (hpcdl's), then the directory.

    keep_status: remove only the owner; the status map, plan and counters stay for inspection
    (--keep-staged). The stager removes its own temporary files (tmp.<thread>) on every exit
    but SIGKILL; release() has hpcdl-stage remove a killed stager's first."""
    try:
        parent = os.open(sessions, DIR_FLAGS)
    except OSError:
        return
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=parent)
        try:
            for entry in os.listdir(fd):
                if keep_status and entry != OWNER:
                    continue
                with contextlib.suppress(OSError):
                    if not stat.S_ISDIR(os.stat(entry, dir_fd=fd, follow_symlinks=False).st_mode):
                        os.unlink(entry, dir_fd=fd)
        finally:
            os.close(fd)
        if not keep_status:
            os.rmdir(name, dir_fd=parent)
    except OSError:
        pass
    finally:
        os.close(parent)


# ------------------------------------------------------------------ small file operations


def make_dir(path: Path, parents: bool = False) -> bool:
    """Create a 0700 directory; True when created here. A symlink or a file there is refused."""
    try:
        path.mkdir(mode=0o700, parents=parents)
        return True
    except FileExistsError:
        pass
    if not stat.S_ISDIR(os.lstat(path).st_mode):
        raise NotADirectoryError(
            errno.ENOTDIR, "exists and is not a directory (or is a symlink)", str(path)
        )
    return False


def write_new(path: Path, text: str | None) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text or "")


def inode_text(path: Path) -> str | None:
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return f"{st.st_ino} {st.st_dev}\n"


def read_text(path: Path) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd) as f:
        return f.read()


def list_dir(path: Path) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def unlink_quietly(path: Path) -> None:
    with contextlib.suppress(OSError):
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            os.unlink(path)


def rmdir_quietly(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.rmdir(path)
