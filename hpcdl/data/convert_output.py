"""The output directory of a conversion: what it may already hold, and the atomic write.

NOTE [conversion output]. Every conversion writes into OUT/.hpcdl-convert-<pid>/, fsyncs each
file, then renames each entry into OUT; on any error that directory is removed, so OUT gains
either all of the new files or none. Before it writes, it refuses (one DataError line):
- an OUT that exists and is not a directory, or that cannot be made;
- an entry it is about to write that exists already (classes.json; OUT/train or OUT/val when
  not empty: those are the data sets HDF5 outputs are read from, so anything in them would
  be read with the new shards, or left beside them unsaid);
- for tar shards, whose data set is OUT itself: any file in OUT that a reader of `--data OUT`
  would take in (hpcdl.data.kinds.kind_of): a *.tar (its samples would join the new ones), a
  compressed tar, an HDF5 file (it would make OUT an HDF5 data set).
Nothing the user had is changed or removed.

A conversion killed by SIGKILL (or on a node that went down) cannot remove its directory. The
next conversion into OUT removes each OUT/.hpcdl-convert-<pid>/ (that name exactly, a real
directory) whose process no longer runs, and says so in one line. The directory holds the name
of the host that made it (HOST_FILE, never moved into OUT): on a shared file system a pid means
nothing on another node, so one made elsewhere is kept, with a one-line note; one without the
file is not provably hpcdl's (a conversion killed as it began, an older hpcdl's, a user's
directory of that name) and is kept too, with a note.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hpcdl.data.dataset import DataError
from hpcdl.data.hdf5 import HDF5_SUFFIXES
from hpcdl.data.tarindex import is_compressed_name
from hpcdl.fsync import fsync_path

HOST_FILE = ".hpcdl-host"  # in a conversion's directory: the host that made it
_LEFTOVER = re.compile(r"\.hpcdl-convert-([1-9][0-9]*)")


@contextmanager
def converted_into(out: Path, names: list[str], holds_data_set: bool = False) -> Iterator[Path]:
    """A new temporary directory inside out; when the block ends without an error, each of its
    entries is renamed into out, else it is removed with everything in it.

    names: the entries the conversion puts in out; holds_data_set: out itself is the data set
    (tar shards), so no file a reader takes may be there. DataError (NOTE above) first."""
    tmp = out / f".hpcdl-convert-{os.getpid()}"
    try:
        check_output(out, names, holds_data_set)
        out.mkdir(parents=True, exist_ok=True)
        remove_leftovers(out)
        tmp.mkdir()
    except OSError as exc:  # a file on the path, no permission, a read-only file system
        raise DataError(f"{out}: cannot write the output there ({exc.strerror or exc})") from None
    try:
        (tmp / HOST_FILE).write_text(socket.gethostname() + "\n")
        yield tmp
        for entry in sorted(tmp.iterdir()):
            if entry.name == HOST_FILE:
                continue
            target = out / entry.name
            if target.is_dir():
                target.rmdir()  # empty (checked above)
            os.replace(entry, target)
        fsync_path(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_output(out: Path, names: list[str], holds_data_set: bool) -> None:
    """DataError when out cannot take the conversion's entries (NOTE [conversion output])."""
    if out.exists() and not out.is_dir():
        raise DataError(f"{out} is a file, not a directory; choose a directory for the output")
    for name in names:
        existing = out / name
        if existing.is_symlink() or (existing.exists() and not existing.is_dir()):
            raise DataError(f"{existing} already exists; remove it or choose another output")
        held = sorted(e.name for e in os.scandir(existing)) if existing.is_dir() else []
        if held:
            raise DataError(
                f"{existing} already exists and holds {held[0]}; remove it or choose another output"
            )
    if holds_data_set and out.is_dir():
        taken = sorted(e.name for e in os.scandir(out) if e.is_file() and _read_as_data(e.name))
        if taken:
            raise DataError(
                f"{out} already holds {taken[0]}, which --data {out} would read with the new "
                "shards; move it away or choose another output"
            )


def _read_as_data(name: str) -> bool:
    """True for a file name a reader of a directory takes in (kinds.kind_of, tarindex)."""
    lower = name.lower()
    return lower.endswith((".tar", *HDF5_SUFFIXES)) or is_compressed_name(lower)


def remove_leftovers(out: Path) -> None:
    """Remove the directory of each conversion into out, made on this host, whose process no
    longer runs (NOTE [conversion output]); one line on stderr for each one found."""
    here = socket.gethostname()
    for entry in sorted(os.scandir(out), key=lambda e: e.name):
        match = _LEFTOVER.fullmatch(entry.name)
        if match is None or not entry.is_dir(follow_symlinks=False):
            continue
        pid, path = int(match.group(1)), Path(entry.path)
        host = _host_of(path)
        if host is None:  # not provably a conversion's: hpcdl deletes only what it made
            print(
                f"hpcdl.data: note: {path}/ holds no {HOST_FILE} (a conversion killed as it "
                "began, an older hpcdl's, or not hpcdl's at all), so it is left as it is; "
                "remove it by hand if it is a conversion's leftover",
                file=sys.stderr,
            )
            continue
        if host != here:
            print(
                f"hpcdl.data: note: {path}/ was left by process {pid} on {host}, which cannot "
                f"be checked from {here}; remove it once that conversion is over",
                file=sys.stderr,
            )
            continue
        if _running(pid):
            continue
        size = _bytes_under(path)
        try:
            shutil.rmtree(path)
        except OSError as exc:
            print(
                f"hpcdl.data: note: cannot remove {path}/, left by conversion process {pid} "
                f"that no longer runs ({exc.strerror or exc}); remove it by hand",
                file=sys.stderr,
            )
            continue
        print(
            f"hpcdl.data: removed {path}/ ({size / 1e6:.1f} MB), left by conversion process "
            f"{pid} that no longer runs",
            file=sys.stderr,
        )


def _host_of(leftover: Path) -> str | None:
    try:
        return (leftover / HOST_FILE).read_text().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def _running(pid: int) -> bool:
    """True when process pid exists on this host (this process's pid: an earlier process's
    directory, since this one has not made its own yet)."""
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    except OverflowError:  # no such pid can exist
        return False
    return True


def _bytes_under(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total
