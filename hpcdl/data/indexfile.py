"""The index file: named NumPy columns in one read-only file that every process of a node maps.

    write_index_file(path, index_bytes({"sizes": a, ...}, meta))  # atomically, mode 0444
    columns, meta = map_index_file(path)  # read-only arrays over one shared mmap

Layout (little-endian): b"HPCDLIX3", a uint64 header length, a UTF-8 JSON header
{"meta": {...}, "columns": {name: [dtype, count, offset]}}, then each column's raw bytes at its
offset, 64-byte aligned. No pickle, no compression: a process that maps the file holds only page
references, which the kernel shares between every process that maps the same file (their PSS
splits the pages, their private memory does not grow), where `np.load` of an .npz copies every
array into every process.
"""

from __future__ import annotations

import json
import mmap
import os
from pathlib import Path
from typing import Any

import numpy as np

from hpcdl.atomic import write_bytes_atomically

MAGIC = b"HPCDLIX3"
_ALIGN = 64
FILE_MODE = 0o444  # nobody rewrites an index in place: a new one replaces it by rename
DIR_MODE = 0o700  # the user's cache directories: their listing is theirs


def _layout(columns: dict[str, np.ndarray], meta: dict[str, Any]) -> tuple[bytes, dict]:
    """(header bytes, {name: offset}) with offsets counted from the start of the file."""
    specs: dict[str, list] = {}
    offsets: dict[str, int] = {}
    header, first = b"", -1
    # The header's length moves the offsets, which it holds: repeat until the first column
    # starts where the header written from those offsets ends (an offset gaining a digit can
    # push the header over a 64-byte boundary).
    while first != _aligned(len(MAGIC) + 8 + len(header)):
        at = first = _aligned(len(MAGIC) + 8 + len(header))
        for name, col in columns.items():
            offsets[name] = at
            specs[name] = [col.dtype.newbyteorder("<").str, int(col.size), at]
            at = _aligned(at + col.nbytes)
        header = json.dumps({"meta": meta, "columns": specs}).encode()
    return header, offsets


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def index_bytes(columns: dict[str, np.ndarray], meta: dict[str, Any]) -> bytes:
    """The index file's bytes (what write_index_file writes; what a rank sends another node)."""
    header, offsets = _layout(columns, meta)
    out = bytearray(MAGIC + len(header).to_bytes(8, "little") + header)
    for name, col in columns.items():
        out += b"\0" * (offsets[name] - len(out))
        out += np.ascontiguousarray(col, col.dtype.newbyteorder("<")).tobytes()
    return bytes(out)


def write_index_file(path: Path, data: bytes) -> bool:
    """Write index_bytes() as path (mode FILE_MODE, whatever the umask) atomically
    (hpcdl.atomic), its missing directories first; False on any OSError (a read-only data root,
    a full cache), with the temporary file removed."""
    try:
        make_dirs(Path(path).parent)
        write_bytes_atomically(path, data, mode=FILE_MODE)
    except OSError:
        return False
    return True


def make_dirs(path: Path) -> None:
    """Create path and its missing parents, each DIR_MODE whatever the umask (mkdir's parents
    would get 0777 less the umask: 0777 itself under umask 000)."""
    missing = []
    while not path.is_dir():
        missing.append(path)
        path = path.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=DIR_MODE)
        except FileExistsError:
            continue  # another process made it meanwhile
        os.chmod(d, DIR_MODE)


def map_index_file(path: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
    """(read-only columns, meta) of an index file, mapped; None when it is missing, unreadable
    or not an index file of this format (the caller rebuilds or looks elsewhere)."""
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size < len(MAGIC) + 8:
                return None
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError):
        return None
    return parse_index(mm)


def parse_index(buf) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
    """(columns, meta) as read-only views of buf (a mapped file, or index_bytes()); None when
    buf is not an index of this format."""
    size = len(buf)
    try:
        if size < len(MAGIC) + 8 or buf[: len(MAGIC)] != MAGIC:
            return None
        n = int.from_bytes(buf[len(MAGIC) : len(MAGIC) + 8], "little")
        head = json.loads(bytes(buf[len(MAGIC) + 8 : len(MAGIC) + 8 + n]).decode())
        columns = {}
        for name, (dtype, count, offset) in head["columns"].items():
            dt = np.dtype(dtype)
            if offset + dt.itemsize * count > size:
                return None
            columns[name] = np.frombuffer(buf, dt, count, offset)
        return columns, head["meta"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None
