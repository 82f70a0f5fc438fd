"""Who owns what in a stage dir: overlap refusal, job sessions under a lock, exact clean-up.

NOTE [stage dir ownership]
hpcdl deletes only what it created, and reuses only bytes whose identity it knows.
- A stage dir that is a data root, lies inside one or contains one (after resolving symlinks)
  is refused before anything is created there.
- Layout, all created with mode 0700:
    <stage>/<data key>/...            staged copies, one tree per data set root (data_key)
    <stage>/.hpcdl/lock               flock'ed while a job joins or leaves
    <stage>/.hpcdl/manifest           every file and directory a stager created (manifest.py)
    <stage>/.hpcdl/sessions/<name>/   one per job on this node: owner, plan, status, progress,
                                      counters and the stager's temporary files
    <stage>/.hpcdl/created            the stage dir's inode, when hpcdl created the stage dir
- A session holds a reference while its owner file names a live process (pid and start time;
  a session of another host always counts as live, since its process cannot be seen).
- Leaving (StageDirLease.release): under the lock the job removes its session. When no live
  session is left and the job does not keep its copies, what the manifest lists is removed:
  every entry whose inode is still the recorded one, reached through directory descriptors
  opened with O_NOFOLLOW, so a symlink is never followed; then hpcdl's own metadata; then the
  stage dir, if hpcdl created it and it is empty. Anything else found there is left alone. The
  copies are renamed away first and removed off the job's path (hpcdl/staging/trash.py, NOTE
  [clean-up off the job's path]); tidy_if_unused is the last step of both.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import re
import secrets
import socket
import stat
import subprocess
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from hpcdl.staging.binary import StagerNotFound, find_stager_binary
from hpcdl.staging.manifest import ManifestRecord

META = ".hpcdl"
SESSIONS = "sessions"
OWNER = "owner"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class StageDirError(ValueError):
    """The stage dir cannot be used as given: one sentence naming it and what to do."""


class StageDirFull(Exception):
    """The stage dir's file system is full at start: staging is skipped, training reads the PFS."""


def check_no_overlap(stage_dir: str | Path, data: Mapping[str, str | Path | None]) -> None:
    """Refuse a stage dir that is, lies inside or contains a data path (flag name -> path)."""
    stage = Path(os.path.realpath(stage_dir))
    for flag, path in data.items():
        if not path:
            continue
        root = Path(os.path.realpath(path))
        if stage == root:
            how = "it is the same directory"
        elif root in stage.parents:
            how = "it lies inside the data"
        elif stage in root.parents:
            how = "it contains the data"
        else:
            continue
        raise StageDirError(
            f"--stage-dir {stage_dir} overlaps {flag} {path} ({how}); staging there could "
            "overwrite or delete the data set: choose a node-local directory outside the data, "
            "e.g. $TMPDIR/hpcdl-stage"
        )


def data_key(root: str | Path) -> str:
    """Directory name, under the stage dir, of one data set root's copies: '<name>-<hash>'."""
    real = os.path.realpath(root)
    name = re.sub(r"[^A-Za-z0-9._-]", "_", os.path.basename(real)).lstrip(".")[:40] or "data"
    return f"{name}-{hashlib.blake2b(os.fsencode(real), digest_size=6).hexdigest()}"


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


@dataclass(frozen=True)
class StageDirLease:
    """One job's reference to a stage dir on this node; see NOTE [stage dir ownership]."""

    stage_dir: Path  # resolved
    session: str  # name of the session directory
    meta: Path  # <stage>/.hpcdl/sessions/<session>: this job's control files

    @classmethod
    def acquire(cls, stage_dir: str | Path) -> StageDirLease:
        """Create the stage dir if needed and register a session; StageDirError if unusable."""
        stage = Path(os.path.realpath(stage_dir))
        session = _session_name()
        layout = StageDir(stage)
        lease = cls(stage, session, layout.session(session).path)
        created = False
        try:
            created = _make_dir(stage, parents=True)
            with _locked(stage):
                if created:
                    _write_new(layout.created, _inode_text(stage))
                _make_dir(layout.sessions)
                _remove_stale_sessions(layout.sessions)
                _remove_unclaimed_trash(stage)
                _make_dir(lease.meta)
                _write_new(lease.files.owner, _owner_text())
        except OSError as exc:
            with contextlib.suppress(OSError):  # leave nothing half-made behind
                lease.release(keep=False)
                if created:
                    _rmdir_quietly(stage)
            raise _usage_error(stage_dir, exc) from None
        return lease

    @property
    def files(self) -> SessionDir:
        """This job's control files (plan, status, progress, counters, owner)."""
        return SessionDir(self.meta)

    def release(self, keep: bool) -> None:
        """Leave: remove this session; the last job out has everything hpcdl created removed,
        renamed away first so that it need not wait (NOTE [clean-up off the job's path])."""
        from hpcdl.staging import trash  # noqa: PLC0415 (trash builds on this module)

        layout = StageDir(self.stage_dir)
        with _locked(self.stage_dir):
            sessions = layout.sessions
            if keep:  # the status map stays for inspection; the session no longer counts
                remove_stager_temporaries(self.stage_dir, self.session)
                _remove_session(sessions, self.session, keep_status=True)
            else:
                _remove_session(sessions, self.session)
            live = [s for s in _list_dir(sessions) if _session_alive(sessions / s)]
            if live or keep:
                return
            entry = trash.move_to_trash(self.stage_dir, self.session)
        size = (entry / "manifest").stat().st_size if entry is not None else 0
        if size > trash.INLINE_MANIFEST_BYTES:
            trash.start_remover(self.stage_dir)
        elif entry is not None:
            trash.remove_trash(self.stage_dir)
        tidy_if_unused(self.stage_dir)


def tidy_if_unused(stage: Path) -> None:
    """Remove hpcdl's metadata, and the stage dir if hpcdl created it, when no live session,
    manifest or trash entry is left (the last job or remover out)."""
    layout = StageDir(stage)
    if not layout.meta.is_dir():
        return
    with _locked(stage):
        sessions = layout.sessions
        if any(_session_alive(sessions / s) for s in _list_dir(sessions)):
            return
        _rmdir_quietly(layout.meta / "trash")
        if os.path.lexists(layout.manifest) or os.path.lexists(layout.meta / "trash"):
            return
        for name in _list_dir(sessions):
            _remove_session(sessions, name)
        _rmdir_quietly(sessions)
        created = _read_text(layout.created)
        for path in (layout.created, layout.lock):
            _unlink_quietly(path)
    _rmdir_quietly(layout.meta)
    if created == _inode_text(stage):
        _rmdir_quietly(stage)


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
            self.fds[""] = os.open(self.root, _DIR_FLAGS)
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
                self.fds[rel] = None if pfd is None else os.open(name, _DIR_FLAGS, dir_fd=pfd)
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
def _locked(stage: Path) -> Iterator[None]:
    """Hold <stage>/.hpcdl/lock; retried when a job that cleaned up removed the lock file."""
    layout = StageDir(stage)
    while True:
        _make_dir(layout.meta)
        fd = os.open(layout.lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            same = os.stat(layout.lock, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        yield
    finally:
        os.close(fd)


def _session_name() -> str:
    host = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())[:60].lstrip(".") or "host"
    return f"{host}-{os.getpid()}-{secrets.token_hex(4)}"


def _process_start(pid: int) -> str | None:
    """Start time of a process (clock ticks since boot), None when it does not exist."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rpartition(")")[2].split()[19]


def _owner_text() -> str:
    return f"{socket.gethostname()}\n{os.getpid()}\n{_process_start(os.getpid())}\n"


def remove_stager_temporaries(stage_dir: Path, session: str) -> None:
    """What a SIGKILLed stager left in its session dir: the stager owns that rule (names and
    safety), so hpcdl-stage --remove-temporaries does it. Nothing to do without a stager."""
    try:
        binary = find_stager_binary()
    except StagerNotFound:
        return
    cmd = [str(binary), "--stage-dir", str(stage_dir), "--session", session, "--remove-temporaries"]
    subprocess.run(cmd, stdin=subprocess.DEVNULL, check=False)


def _session_alive(session: Path) -> bool:
    lines = (_read_text(SessionDir(session).owner) or "").split("\n")
    if len(lines) < 3 or not lines[1].isdigit():
        return False
    if lines[0] != socket.gethostname():
        return True  # another host's process: cannot be checked, so it keeps its reference
    return _process_start(int(lines[1])) == lines[2]


def _remove_unclaimed_trash(stage: Path) -> None:
    """What an ended job's remover could not finish (killed with the job) goes now, off this
    job's path too (NOTE [clean-up off the job's path])."""
    from hpcdl.staging import trash  # noqa: PLC0415 (trash builds on this module)

    if trash.unclaimed(stage):
        trash.start_remover(stage)


def _remove_stale_sessions(sessions: Path) -> None:
    for name in _list_dir(sessions):
        if not _session_alive(sessions / name):
            _remove_session(sessions, name)


def _remove_session(sessions: Path, name: str, keep_status: bool = False) -> None:
    """Remove one session directory: the files directly in it (hpcdl's), then the directory.

    keep_status: remove only the owner; the status map, plan and counters stay for inspection
    (--keep-staged). The stager removes its own temporary files (tmp.<thread>) on every exit
    but SIGKILL; release() has hpcdl-stage remove a killed stager's first."""
    try:
        parent = os.open(sessions, _DIR_FLAGS)
    except OSError:
        return
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
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


def _make_dir(path: Path, parents: bool = False) -> bool:
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


def _write_new(path: Path, text: str | None) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text or "")


def _inode_text(path: Path) -> str | None:
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return f"{st.st_ino} {st.st_dev}\n"


def _read_text(path: Path) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd) as f:
        return f.read()


def _list_dir(path: Path) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _unlink_quietly(path: Path) -> None:
    with contextlib.suppress(OSError):
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            os.unlink(path)


def _rmdir_quietly(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.rmdir(path)


def _usage_error(stage_dir: str | Path, exc: OSError) -> StageDirFull | StageDirError:
    """ENOSPC/EDQUOT: StageDirFull (the job goes on without staging); else a StageDirError."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return StageDirFull(f"no space left in --stage-dir {stage_dir}: {exc.strerror}")
    where = f" ({exc.filename})" if exc.filename and str(exc.filename) != str(stage_dir) else ""
    return StageDirError(
        f"cannot use --stage-dir {stage_dir}{where}: {exc.strerror or exc}; choose a writable "
        "directory on node-local storage"
    )
