"""The members of a tar file from its headers (no member's data is read), through a window.

Formats: POSIX ustar (with its name prefix), GNU (long names in 'L' members, base-256 sizes) and
pax (a 'path' or 'size' record in an 'x' member; global 'g' records are skipped). Every header's
checksum is checked. Python's tarfile reads the same, at about five times the cost per member
(a TarInfo and its fields parsed per member): ImageNet's 2.56 M members are the index's
critical path.

ShardWindow: every read of the index goes through one window of WINDOW bytes. A read inside the
last pread's bytes costs no system call (and, on a parallel file system, no request); else one
pread of at least WINDOW bytes from there. While the headers are read, the first `keep` bytes
of each member's data that the window holds are kept, and a later read of them is served from
there. In a WebDataset shard a sample's headers, its label member and its image's first bytes
lie within a few KB, whichever order the writer put the members in (hpcdl's convert: the image
first; webdataset's TarWriter: the label), so a sample takes one pread: the labels and image
heads (hpcdl.data.tarindex) were kept on the way.
"""

from __future__ import annotations

import os

BLOCK = 512
WINDOW = 8192  # a label, a header and an image's head (hpcdl.data.tarindex reads 4 KB of it)
_ZERO = bytes(BLOCK)
_REGULAR = (b"0", b"\0", b"7")


class ShardWindow:
    """Reads of one open file served from the bytes of its last pread, or from the member
    heads kept on the way (module notes)."""

    def __init__(self, fd: int, keep: int = 0, window: int = WINDOW) -> None:
        self.fd, self.keep_bytes, self.window = fd, keep, window
        self._at, self._data = 0, b""
        self._kept: dict[int, bytes] = {}  # data offset -> the member's first bytes

    def read(self, length: int, at: int) -> bytes:
        """length bytes at offset at (fewer only past the end of the file), as os.pread."""
        kept = self._kept.get(at)
        if kept is not None and length <= len(kept):
            return kept[:length]
        start = at - self._at
        if start >= 0 and start + length <= len(self._data):
            return self._data[start : start + length]
        self._at, self._data = at, os.pread(self.fd, max(length, self.window), at)
        return self._data[:length]

    def keep(self, at: int, length: int) -> None:
        """Keep the first min(length, keep) bytes at `at` (a member's data) where the window
        holds them all."""
        n, start = min(length, self.keep_bytes), at - self._at
        if n and start >= 0 and start + n <= len(self._data):
            self._kept[at] = self._data[start : start + n]


def tar_members(
    fd: int, size: int, window: ShardWindow | None = None
) -> tuple[list[tuple[str, int, int]], int | None]:
    """([(name, data offset, length)] of the regular members, in order; the byte where a
    header is cut short or damaged, or None when the archive ends as it should). window: the
    one to read fd through (else a new one)."""
    reads = window or ShardWindow(fd)
    out: list[tuple[str, int, int]] = []
    at, long_name, pax = 0, None, {}
    while at < size:
        block = reads.read(BLOCK, at)
        if block == _ZERO:
            return out, None  # the end-of-archive blocks
        try:
            if len(block) < BLOCK or not _checksum_ok(block):
                return out, at
            kind, length = block[156:157], _number(block[124:136])
            data_at = at + BLOCK
            if kind == b"L":
                long_name = _text(reads.read(length, data_at))
            elif kind == b"x":
                pax = _pax_records(reads.read(length, data_at))
            elif kind != b"g":
                if kind in _REGULAR:
                    length = int(pax.get("size", length))
                    name = pax.get("path") or long_name or _ustar_name(block)
                    out.append((name, data_at, length))
                    reads.keep(data_at, length)
                long_name, pax = None, {}
        except ValueError:  # a number that is not one: a damaged header
            return out, at
        at = data_at + -(-length // BLOCK) * BLOCK
    return out, None


def _checksum_ok(block: bytes) -> bool:
    try:
        stored = _number(block[148:156])
    except ValueError:
        return False
    return stored == sum(block[:148]) + 8 * 32 + sum(block[156:])


def _number(field: bytes) -> int:
    """An octal field, or GNU's base-256 (first byte 0x80) for large sizes."""
    if field[0] & 0x80:
        return int.from_bytes(field[1:], "big")
    return int(field.strip(b"\0 ") or b"0", 8)


def _text(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


def _ustar_name(block: bytes) -> str:
    name = _text(block[:100])
    if block[257:263] == b"ustar\0":  # POSIX: a prefix (GNU keeps other fields there)
        prefix = _text(block[345:500])
        return f"{prefix}/{name}" if prefix else name
    return name


def _pax_records(raw: bytes) -> dict[str, str]:
    """The 'length key=value\\n' records of a pax header."""
    records, pos = {}, 0
    while pos < len(raw):
        space = raw.find(b" ", pos)
        if space < 0:
            break
        length = int(raw[pos:space])
        if length <= 0:
            break
        key, _, value = raw[space + 1 : pos + length - 1].partition(b"=")
        records[key.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
        pos += length
    return records
