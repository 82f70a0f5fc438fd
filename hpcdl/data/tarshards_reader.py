"""Reading samples of tar shards: one pread per sample from the shard's open descriptor.

NOTE [tar shards] in hpcdl/data/tarshards.py. Each reading process (the training process, each
loader worker) owns its reader and keeps up to MAX_OPEN_SHARDS descriptors open, least recently
used closed first. A staged copy is preferred while the stager reports it READY; one it has
evicted since is closed at the next sweep (every SWEEP_EVERY shard opens): an open descriptor
would keep an unlinked copy's blocks on the stage disk, beyond its capacity. Decoding, crops and
the counts are the image folder's reader's (ImageFolderReader.decode over the sample's bytes).
"""

from __future__ import annotations

import io
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

from hpcdl.data.dataset import BadSample, Locate
from hpcdl.data.imagefolder import ImageFolderReader
from hpcdl.data.pfs import open_latency, throttle
from hpcdl.data.tarindex import FLAW_REASONS, LABEL_RANGE

MAX_OPEN_SHARDS = 64
SWEEP_EVERY = 16  # shard opens between checks for evicted staged copies held open


class TarShardReader(ImageFolderReader):
    """Decodes samples in the process that owns it (the image folder's decode), each read with
    one pread from the shard's descriptor, kept open (MAX_OPEN_SHARDS, least recently used
    closed first)."""

    def __init__(self, ds: Any, locate: Locate | None) -> None:
        """ds: a TarShardDataset."""
        super().__init__(ds, locate)
        self._fds: OrderedDict[int, tuple[int, Path]] = OrderedDict()
        self._opened = 0

    def _open(self, index: int):
        """(the sample's image bytes as a file, '<shard> (member <name>)'); BadSample when the
        sample is flawed or its shard cannot be read."""
        ds, cols = self.ds, self.ds.index.columns
        flaw = int(cols["flaws"][index])
        if flaw:
            reason = FLAW_REASONS[flaw]
            if flaw == LABEL_RANGE:
                reason += f" ({ds.num_classes} classes, from {ds.index.meta['classes_from']})"
            raise BadSample(ds.where(index), index, reason)
        fid = int(ds.file_ids([index])[0])
        at, length = int(cols["data_at"][index]), int(cols["data_len"][index])
        staged = self._piece(fid, index, at, length)
        if staged is not None:
            self.counts.local += 1
            return io.BytesIO(staged[0]), ds.where(index, staged[1])
        fd, path = self._shard(fid, index)
        try:
            data = _read_at(fd, length, at)
        except OSError as exc:
            raise BadSample(ds.where(index, path), index, exc.strerror or str(exc)) from None
        if len(data) < length:
            raise BadSample(
                ds.where(index, path), index,
                f"the shard is {os.fstat(fd).st_size} bytes now, and the member ends at byte "
                f"{at + length}: it was truncated after it was indexed; restore it",
            )  # fmt: skip
        if path == self.pfs(fid):
            throttle(length, self.emulation)
            self.counts.pfs += 1
        else:
            self.counts.local += 1
        return io.BytesIO(data), ds.where(index, path)

    def _piece(self, fid: int, index: int, at: int, length: int) -> tuple[bytes, Path] | None:
        """(the sample's bytes, the piece's path) from its staged piece (hpcdl.staging.pieces)
        when the stager has one READY with the sample's length, else None: the shard is read."""
        locate_piece = getattr(self.locate, "piece", None)
        path = locate_piece(fid, index, at) if locate_piece is not None else None
        if path is None:
            return None
        try:
            with open(path, "rb") as f:
                data = f.read(length + 1)
        except OSError:
            return None  # evicted meanwhile
        return (data, path) if len(data) == length else None

    def _shard(self, fid: int, index: int) -> tuple[int, Path]:
        """(open descriptor, path) of shard fid: its staged copy, else the PFS original."""
        path, pfs = Path(self.locate(fid)), self.pfs(fid)
        held = self._fds.get(fid)
        if held is not None and held[1] == path:
            self._fds.move_to_end(fid)
            return held
        if held is not None:
            os.close(self._fds.pop(fid)[0])
        self._opened += 1
        if self._opened % SWEEP_EVERY == 0:
            self._close_evicted()
        fd = self._open_checked(path, pfs, fid, index) if path != pfs else None
        if fd is None:
            path, fd = pfs, self._open_checked(pfs, pfs, fid, index)
        self._fds[fid] = (fd, path)
        while len(self._fds) > MAX_OPEN_SHARDS:
            os.close(self._fds.popitem(last=False)[1][0])
        return fd, path

    def _close_evicted(self) -> None:
        """Close the staged copies the stager has evicted since they were opened: an open
        descriptor keeps an unlinked file's blocks on the stage disk, beyond its capacity."""
        for fid, (fd, path) in list(self._fds.items()):
            if path != self.pfs(fid) and Path(self.locate(fid)) != path:
                os.close(fd)
                del self._fds[fid]

    def _open_checked(self, path: Path, pfs: Path, fid: int, index: int) -> int | None:
        """A descriptor of path when it is the indexed shard; for a staged copy (path != pfs)
        None instead of BadSample (the original is read)."""
        size, mtime = int(self.ds.files.sizes[fid]), int(self.ds.index.columns["mtimes"][fid])
        try:
            if path == pfs:
                open_latency(self.emulation)
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            if path != pfs:
                return None
            raise BadSample(self.ds.where(index, path), index, exc.strerror or str(exc)) from None
        st = os.fstat(fd)
        if st.st_size == size and st.st_mtime_ns == mtime:  # the stager keeps the mtime
            return fd
        os.close(fd)
        if path != pfs:
            return None
        raise BadSample(
            self.ds.where(index, path), index,
            f"the shard changed since its index was built ({size} bytes then, {st.st_size} "
            "now, or a new mtime); restore it, or start a new run to index it again",
        )  # fmt: skip

    def close(self) -> None:
        while self._fds:
            os.close(self._fds.popitem()[1][0])


def _read_at(fd: int, length: int, at: int) -> bytes:
    """length bytes at offset at, fewer only at the end of the file: one pread, more only where
    the file system returns part of a read."""
    data = os.pread(fd, length, at)
    while len(data) < length:
        more = os.pread(fd, length - len(data), at + len(data))
        if not more:
            break
        data += more
    return data
