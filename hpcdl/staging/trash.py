"""Removing a stage dir's copies off the job's path: renamed away at the end, removed after.

NOTE [clean-up off the job's path]
Removing 126,274 staged files took longer than the job's last epoch's tail (27.5 s; `rm -rf`
19.4 s), and 1.28 M files take minutes: the job must not wait for it. So the last job out
(StageDirLease.release, not --keep-staged), under the stage dir's lock:
1. makes <stage>/.hpcdl/trash/<session>/{manifest,tree/} (mode 0700) and hard-links the
   manifest there first: from then on that entry names what it must remove;
2. renames every top-level manifest entry (the data sets' trees, <stage>/<data key>) whose
   inode is still the recorded one into tree/, through directory descriptors, never following
   a symlink (renameat moves a symlink itself; the removal refuses to enter it);
3. unlinks <stage>/.hpcdl/manifest.
Renames are O(data sets), so the job leaves at once; a new job on the node sees an empty stage
dir. Then the removal (remove_trash): an entry's remover holds flock(LOCK_EX) on its manifest, so
a live remover is proven by the lock, a dead one (SIGKILL, a batch system killing the job's
processes at its end) by the lock being free. It removes exactly the manifest's records, below
tree/, by remove_created's rules (inode still the recorded one, directory descriptors, O_NOFOLLOW),
then puts back where it was what is left (not hpcdl's: a user's file in a staged directory),
then removes the manifest and the entry.
Who removes: the releasing job itself when the manifest is at most INLINE_MANIFEST_BYTES
(about 4,000 files, well under a second); else a detached process (`python -m
hpcdl.staging.trash STAGE_DIR`, its own session, stdio closed) that outlives the job; it runs
while the job's processes end, so it imports the standard library and its own two modules only
(hpcdl.staging's names load when asked for; tests/test_staging_cleanup.py). Every
StageDirLease.acquire starts one when an entry is unclaimed (its lock free), so what a killed
remover left goes with the next job on the node that uses the stage dir; a Slurm epilog can run
the same command. The last remover out (no live session, no manifest, no trash) removes hpcdl's
metadata and the stage dir, like release.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import stat
import subprocess
import sys
from pathlib import Path

from hpcdl.staging.layout import (
    DIR_FLAGS,
    META,
    StageDir,
    list_dir,
    locked,
    make_dir,
    remove_created,
    rmdir_quietly,
    tidy_if_unused,
)
from hpcdl.staging.manifest import ManifestRecord, decode_records, read_manifest

TRASH = "trash"
TREE = "tree"
# A manifest of at most this many bytes (about 4,000 files) is removed by the releasing job.
INLINE_MANIFEST_BYTES = 512 << 10


def trash_root(stage: Path) -> Path:
    return StageDir(stage).meta / TRASH


def move_to_trash(stage: Path, name: str) -> Path | None:
    """Steps 1-3 of NOTE [clean-up off the job's path]; the caller holds the stage dir's lock.

    Returns the trash entry, or None when there is no manifest. A top-level entry that cannot
    be renamed (EXDEV: a mount point) is removed in place, here."""
    layout = StageDir(stage)
    tops = top_level_records(stage)
    if tops is None:
        return None
    entry = trash_root(stage) / name
    make_dir(trash_root(stage))
    make_dir(entry)
    make_dir(entry / TREE)
    os.link(layout.manifest, entry / "manifest", follow_symlinks=False)
    stuck = []
    src = os.open(stage, DIR_FLAGS)
    dst = os.open(entry / TREE, DIR_FLAGS)
    try:
        for record in tops:
            if not _move_one(src, dst, record):
                stuck.append(record.dest)
    finally:
        os.close(src)
        os.close(dst)
    if stuck:  # not renameable: removed where they are, as before
        records = read_manifest(layout.manifest)
        remove_created(stage, [r for r in records if r.dest.split("/")[0] in set(stuck)])
    os.unlink(layout.manifest)
    return entry


def top_level_records(stage: Path) -> list[ManifestRecord] | None:
    """The manifest's records of entries directly in the stage dir; None without a manifest.

    Found by searching the manifest for each name in the stage dir, not by decoding every
    record (1.28 M records take seconds in Python; the job must not wait for that). A record's
    payload starts right after the one newline of its header "R1 <length>\n", and no name holds
    a newline or NUL (planner and stager refuse control characters), so b"\n<kind>\0<name>\0"
    matches only the start of a real record of that name."""
    try:
        fd = os.open(StageDir(stage).manifest, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return []
        with mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as data:
            return [
                record
                for name in list_dir(stage)
                if name != META
                for kind in (b"d", b"f")
                for record in _records_named(data, kind, os.fsencode(name))
            ]


def _records_named(data: mmap.mmap, kind: bytes, name: bytes) -> list[ManifestRecord]:
    out, key = [], b"\n" + kind + b"\0" + name + b"\0"
    pos = data.find(key)
    while pos >= 0:
        start = data.rfind(b"R1 ", max(0, pos - 32), pos)
        length = data[start + 3 : pos]
        if start >= 0 and length.isdigit():
            out += decode_records(data[start : pos + 1 + int(length)])
        pos = data.find(key, pos + 1)
    return [r for r in out if r.dest == os.fsdecode(name)]


def _move_one(src: int, dst: int, record: ManifestRecord) -> bool:
    """Rename src/name to dst/name when it is still the recorded file or directory; False when
    it must be removed in place instead (the rename failed other than by its absence)."""
    name = record.dest
    try:
        st = os.stat(name, dir_fd=src, follow_symlinks=False)
    except OSError:
        return True  # gone: nothing to move
    kind = stat.S_ISDIR if record.kind == "d" else stat.S_ISREG
    if not kind(st.st_mode) or (st.st_ino, st.st_dev) != (record.copy_ino, record.copy_dev):
        return True  # not ours (any more): it stays
    try:
        os.rename(name, name, src_dir_fd=src, dst_dir_fd=dst)
    except OSError as exc:
        return exc.errno == errno.ENOENT
    return True


def remove_trash(stage: Path) -> int:
    """Remove every unclaimed trash entry of the stage dir; then tidy (see the NOTE). Returns
    the number of files removed. Entries whose remover is alive are skipped."""
    stage = Path(os.path.realpath(stage))
    removed = 0
    for name in list_dir(trash_root(stage)):
        removed += _remove_entry(trash_root(stage) / name)
    with contextlib.suppress(OSError):
        tidy_if_unused(stage)
    return removed


def _remove_entry(entry: Path) -> int:
    """Remove one trash entry while holding its manifest's lock; 0 when another holds it."""
    try:
        fd = os.open(entry / "manifest", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        rmdir_quietly(entry / TREE)  # a finished entry, or one holding what is not ours
        rmdir_quietly(entry)
        return 0
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return 0  # a live remover has it
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return 0
        with os.fdopen(os.dup(fd), "rb") as f:
            records = decode_records(f.read())
        removed = remove_created(entry / TREE, records)
        _put_back(entry)
        os.unlink(entry / "manifest")
    finally:
        os.close(fd)
    rmdir_quietly(entry / TREE)
    rmdir_quietly(entry)
    return removed


def _put_back(entry: Path) -> None:
    """Move what is left in tree/ (not hpcdl's: a user's file in a staged directory) back to
    where it was in the stage dir, unless that name is taken again."""
    stage = entry.parent.parent.parent
    with locked(stage):
        src = os.open(entry / TREE, DIR_FLAGS)
        dst = os.open(stage, DIR_FLAGS)
        try:
            for name in os.listdir(src):
                try:
                    os.stat(name, dir_fd=dst, follow_symlinks=False)
                except FileNotFoundError:
                    with contextlib.suppress(OSError):
                        os.rename(name, name, src_dir_fd=src, dst_dir_fd=dst)
        finally:
            os.close(src)
            os.close(dst)


def unclaimed(stage: Path) -> bool:
    """True when a trash entry's manifest is not locked by a live remover."""
    for name in list_dir(trash_root(stage)):
        try:
            fd = os.open(trash_root(stage) / name / "manifest", os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError:
            continue
        finally:
            os.close(fd)
    return False


def start_remover(stage: Path) -> subprocess.Popen:
    """A detached `python -m hpcdl.staging.trash STAGE` that outlives this process."""
    return subprocess.Popen(
        [sys.executable, "-m", "hpcdl.staging.trash", str(stage)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
    )


def main(argv: list[str] | None = None) -> int:
    """`python -m hpcdl.staging.trash STAGE_DIR`: remove what ended jobs left to remove there."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m hpcdl.staging.trash STAGE_DIR", file=sys.stderr)
        return 2
    remove_trash(Path(args[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
