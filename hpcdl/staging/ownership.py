"""Who owns what in a stage dir: overlap refusal, job sessions under a lock, exact clean-up.

NOTE [stage dir ownership]
hpcdl deletes only what it created, and reuses only bytes whose identity it knows.
- A stage dir that is a data root, lies inside one or contains one (after resolving symlinks)
  is refused before anything is created there. The root of a tar shard pattern or of one .tar
  is the directory that holds the shards (data_root).
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
import hashlib
import os
import re
import secrets
import socket
import stat
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from hpcdl.staging import trash
from hpcdl.staging.binary import StagerNotFound, find_stager_binary
from hpcdl.staging.layout import (
    META,
    SessionDir,
    StageDir,
    inode_text,
    list_dir,
    locked,
    make_dir,
    process_start,
    remove_session,
    rmdir_quietly,
    session_alive,
    tidy_if_unused,
    write_new,
)


class StageDirError(ValueError):
    """The stage dir cannot be used as given: one sentence naming it and what to do."""


class StageDirFull(Exception):
    """The stage dir's file system is full at start: staging is skipped, training reads the PFS."""


def data_root(path: str | Path) -> Path:
    """Where a data path's files are, which a stage dir must keep out of: the directory that
    holds the shards of a tar pattern (shards-{000..099}.tar) or of one .tar file; any other
    path (a directory, an HDF5 file) as given."""
    from hpcdl.data.tarindex import is_brace_pattern, shard_root  # noqa: PLC0415

    p = Path(path)
    if is_brace_pattern(p):
        return shard_root(p)
    if p.is_file():
        from hpcdl.data.kinds import kind_of  # noqa: PLC0415

        return shard_root(p) if kind_of(p) == "tar" else p
    return p


def check_no_overlap(stage_dir: str | Path, data: Mapping[str, str | Path | None]) -> None:
    """Refuse a stage dir that is, lies inside or contains a data path's root (flag name ->
    path; data_root), all symlinks resolved."""
    stage = Path(os.path.realpath(stage_dir))
    for flag, path in data.items():
        if not path:
            continue
        given = data_root(path)
        root = Path(os.path.realpath(given))
        if stage == root:
            how = "it is the same directory"
        elif root in stage.parents:
            how = "it lies inside the data"
        elif stage in root.parents:
            how = "it contains the data"
        else:
            continue
        named = (
            f"{flag} {path}" if given == Path(path) else f"{given}, the directory of {flag} {path}"
        )
        raise StageDirError(
            f"--stage-dir {stage_dir} overlaps {named} ({how}); staging there could "
            "overwrite or delete the data set: choose a node-local directory outside the data, "
            "e.g. $TMPDIR/hpcdl-stage"
        )


def check_stage_dir(stage_dir: str | Path, data: Mapping[str, str | Path | None]) -> None:
    """What can be said of a stage dir before anything is created: StageDirError when it
    overlaps a data path, or when it or its .hpcdl exists as a file or a symlink."""
    check_no_overlap(stage_dir, data)
    stage = Path(stage_dir)
    for path in (stage, stage / META):
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            return  # missing (created later), or not reachable: the lease says why
        if not stat.S_ISDIR(mode):
            err = OSError(errno.ENOTDIR, "exists and is not a directory (or is a symlink)")
            err.filename = str(path)
            raise _usage_error(stage_dir, err)


def data_key(root: str | Path) -> str:
    """Directory name, under the stage dir, of one data set root's copies: '<name>-<hash>'."""
    real = os.path.realpath(root)
    name = re.sub(r"[^A-Za-z0-9._-]", "_", os.path.basename(real)).lstrip(".")[:40] or "data"
    return f"{name}-{hashlib.blake2b(os.fsencode(real), digest_size=6).hexdigest()}"


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
            created = make_dir(stage, parents=True)
            with locked(stage):
                if created:
                    write_new(layout.created, inode_text(stage))
                make_dir(layout.sessions)
                _remove_stale_sessions(layout.sessions)
                _remove_unclaimed_trash(stage)
                make_dir(lease.meta)
                write_new(lease.files.owner, _owner_text())
        except OSError as exc:
            with contextlib.suppress(OSError):  # leave nothing half-made behind
                lease.release(keep=False)
                if created:
                    rmdir_quietly(stage)
            raise _usage_error(stage_dir, exc) from None
        return lease

    @property
    def files(self) -> SessionDir:
        """This job's control files (plan, status, progress, counters, owner)."""
        return SessionDir(self.meta)

    def release(self, keep: bool) -> None:
        """Leave: remove this session; the last job out has everything hpcdl created removed,
        renamed away first so that it need not wait (NOTE [clean-up off the job's path])."""
        layout = StageDir(self.stage_dir)
        with locked(self.stage_dir):
            sessions = layout.sessions
            if keep:  # the status map stays for inspection; the session no longer counts
                remove_stager_temporaries(self.stage_dir, self.session)
                remove_session(sessions, self.session, keep_status=True)
            else:
                remove_session(sessions, self.session)
            live = [s for s in list_dir(sessions) if session_alive(sessions / s)]
            if live or keep:
                return
            entry = trash.move_to_trash(self.stage_dir, self.session)
        size = (entry / "manifest").stat().st_size if entry is not None else 0
        if size > trash.INLINE_MANIFEST_BYTES:
            trash.start_remover(self.stage_dir)
        elif entry is not None:
            trash.remove_trash(self.stage_dir)
        tidy_if_unused(self.stage_dir)


def _session_name() -> str:
    host = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())[:60].lstrip(".") or "host"
    return f"{host}-{os.getpid()}-{secrets.token_hex(4)}"


def _owner_text() -> str:
    return f"{socket.gethostname()}\n{os.getpid()}\n{process_start(os.getpid())}\n"


def remove_stager_temporaries(stage_dir: Path, session: str) -> None:
    """What a SIGKILLed stager left in its session dir: the stager owns that rule (names and
    safety), so hpcdl-stage --remove-temporaries does it. Nothing to do without a stager."""
    try:
        binary = find_stager_binary()
    except StagerNotFound:
        return
    cmd = [str(binary), "--stage-dir", str(stage_dir), "--session", session, "--remove-temporaries"]
    subprocess.run(cmd, stdin=subprocess.DEVNULL, check=False)


def _remove_unclaimed_trash(stage: Path) -> None:
    """What an ended job's remover could not finish (killed with the job) goes now, off this
    job's path too (NOTE [clean-up off the job's path])."""
    if trash.unclaimed(stage):
        trash.start_remover(stage)


def _remove_stale_sessions(sessions: Path) -> None:
    for name in list_dir(sessions):
        if not session_alive(sessions / name):
            remove_session(sessions, name)


def _usage_error(stage_dir: str | Path, exc: OSError) -> StageDirFull | StageDirError:
    """ENOSPC/EDQUOT: StageDirFull (the job goes on without staging); else a StageDirError."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return StageDirFull(f"no space left in --stage-dir {stage_dir}: {exc.strerror}")
    where = f" ({exc.filename})" if exc.filename and str(exc.filename) != str(stage_dir) else ""
    return StageDirError(
        f"cannot use --stage-dir {stage_dir}{where}: {exc.strerror or exc}; choose a writable "
        "directory on node-local storage"
    )
