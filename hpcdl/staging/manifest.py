"""Reading the stager's manifest (<stage_dir>/.hpcdl/manifest): what hpcdl created there.

The C++ stager owns the format (staging/src/manifest.h) and is its only writer; this reader
mirrors its decoder, and tests/test_staging_manifest.py checks that the two agree. Records are
"R1 <length>\\n" + <length> bytes of NUL-separated fields, so names may hold any byte but NUL. A
torn or malformed tail ends the reading: clean-up then removes less, never something else.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

MAX_RECORD = 1 << 16
_FIELDS = 10


class ManifestRecord(NamedTuple):
    """One file ('f') or directory ('d') that a stager created in the stage dir."""

    kind: str
    dest: str  # relative to the stage dir
    source: str  # the PFS path copied from ("" for a directory)
    source_identity: tuple[int, int, int, int, int]  # size, mtime_ns, ctime_ns, inode, device
    copy_ino: int
    copy_dev: int


def decode_records(data: bytes) -> list[ManifestRecord]:
    """Every complete, well-formed record from the start of data."""
    out, pos = [], 0
    while pos < len(data):
        if data[pos : pos + 3] != b"R1 ":
            break
        nl = data.find(b"\n", pos + 3)
        length_text = data[pos + 3 : nl] if nl > 0 else b""
        if not length_text.isdigit() or int(length_text) > MAX_RECORD:
            break
        end = nl + 1 + int(length_text)
        if end > len(data):
            break
        fields = data[nl + 1 : end].split(b"\0")
        if len(fields) != _FIELDS or fields[0] not in (b"f", b"d"):
            break
        if not all(f.isdigit() and len(f) <= 20 for f in fields[3:]):
            break
        numbers = [int(f) for f in fields[3:]]
        out.append(
            ManifestRecord(
                kind=fields[0].decode(),
                dest=os.fsdecode(fields[1]),
                source=os.fsdecode(fields[2]),
                source_identity=tuple(numbers[:5]),
                copy_ino=numbers[5],
                copy_dev=numbers[6],
            )
        )
        pos = end
    return out


def read_manifest(path: str | Path) -> list[ManifestRecord]:
    """The records of a manifest file; [] when there is none. Never follows a symlink."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (FileNotFoundError, OSError):
        return []
    with os.fdopen(fd, "rb") as f:
        return decode_records(f.read())
