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
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hpcdl.data.dataset import DataError
from hpcdl.data.hdf5 import HDF5_SUFFIXES
from hpcdl.data.tarindex import is_compressed_name
from hpcdl.fsync import fsync_path


@contextmanager
def converted_into(out: Path, names: list[str], holds_data_set: bool = False) -> Iterator[Path]:
    """A new temporary directory inside out; when the block ends without an error, each of its
    entries is renamed into out, else it is removed with everything in it.

    names: the entries the conversion puts in out; holds_data_set: out itself is the data set
    (tar shards), so no file a reader takes may be there. DataError (NOTE above) first."""
    check_output(out, names, holds_data_set)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(
            f"{out}: cannot make the output directory ({exc.strerror or exc})"
        ) from None
    tmp = out / f".hpcdl-convert-{os.getpid()}"
    try:
        tmp.mkdir()
        yield tmp
        for entry in sorted(tmp.iterdir()):
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
