"""A ring of minibatch slots in one shared-memory file, and the fixed-size control messages.

Slot layout (each slot page-aligned): indices int64 (B,) | labels int64 (B,) | images float32
(B, C, H, W); or, for byte slots (`--decode gpu`: the workers read compressed files, the rank
decodes), indices | labels | offsets int64 (B + 1,) | up to byte_capacity bytes of files.
The file is created in /dev/shm (or $HPCDL_SHM_DIR), space reserved with posix_fallocate, and
unlinked at once: workers get the descriptor, so no name can leak, not even when the training
process is killed.
"""

from __future__ import annotations

import mmap
import os
import secrets
import struct
from dataclasses import dataclass

import numpy as np

from hpcdl.data.dataset import DataError

PAGE = mmap.PAGESIZE

# parent -> worker: op, slot, epoch, batch number, samples in batch, train flag
TASK = struct.Struct("<iiqqii")
# worker -> parent: op, slot, batch number, local reads, PFS reads, bad samples, error text length
REPLY = struct.Struct("<iiqiiii")
OP_BUILD, OP_STOP = 1, 2
OP_DONE, OP_DATA_ERROR, OP_READY, OP_FAILED = 1, 2, 3, 4


class SharedMemoryTooSmall(DataError):
    """/dev/shm cannot hold the loader's batch slots."""


def shm_dir() -> str:
    return os.environ.get("HPCDL_SHM_DIR", "/dev/shm")


def free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _too_small(need: int, free: int, where: str, slots: int, slot_bytes: int) -> str:
    mib = 1 << 20
    return (
        f"the data loader needs {need / mib:.1f} MiB of shared memory in {where} "
        f"({slots} slots x {slot_bytes / mib:.1f} MiB) but only {free / mib:.1f} MiB are free; "
        f"enlarge it (docker/podman: --shm-size={max(1, -(-2 * need // (1 << 30)))}g; as root: "
        f"mount -o remount,size=<bytes> {where}), point HPCDL_SHM_DIR at a larger tmpfs, or "
        "lower --prefetch or --batch-size"
    )


@dataclass(frozen=True)
class SlotLayout:
    """Where each slot and each array in it lie; the pool and its workers share this value.

    count slots of batch_size samples of shape (C, H, W); offsets and sizes in bytes.
    byte_capacity > 0: byte slots holding that many bytes of files, no images.
    """

    count: int
    batch_size: int
    shape: tuple[int, int, int]
    byte_capacity: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.shape))

    @property
    def labels_offset(self) -> int:
        return 8 * self.batch_size

    @property
    def images_offset(self) -> int:
        return _round_up(16 * self.batch_size, 64)

    @property
    def slot_bytes(self) -> int:
        if self.byte_capacity:
            payload = 8 * (self.batch_size + 1) + self.byte_capacity
        else:
            payload = self.batch_size * int(np.prod(self.shape)) * 4
        return _round_up(self.images_offset + payload, PAGE)

    @property
    def total_bytes(self) -> int:
        return self.slot_bytes * self.count


def shm_shortfall(layout: SlotLayout, ranks: int = 1) -> str | None:
    """The line SlotRing would raise SharedMemoryTooSmall with when `ranks` rings of `layout`
    do not fit in the free shared memory now (hpcdl.doctor asks before a run), else None."""
    where = shm_dir()
    free, total = free_bytes(where), layout.total_bytes * ranks
    if free >= total:
        return None
    return _too_small(total, free, where, layout.count * ranks, layout.slot_bytes)


class SlotRing:
    """The slots of `layout` in one file; the creator owns the mapping and the descriptor."""

    def __init__(self, layout: SlotLayout) -> None:
        self.layout = layout
        total, slot_bytes = layout.total_bytes, layout.slot_bytes
        where = shm_dir()
        free = free_bytes(where)
        if free < total:
            raise SharedMemoryTooSmall(_too_small(total, free, where, layout.count, slot_bytes))
        path = os.path.join(where, f"hpcdl-loader-{os.getpid()}-{secrets.token_hex(4)}")
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.unlink(path)
        try:
            os.posix_fallocate(self.fd, 0, total)
        except OSError as exc:
            os.close(self.fd)
            raise SharedMemoryTooSmall(
                _too_small(total, free_bytes(where), where, layout.count, slot_bytes)
                + f" ({exc.strerror})"
            ) from None
        self.mm = mmap.mmap(self.fd, total)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            self.mm.close()
        except BufferError:
            pass  # the caller still holds a batch view; the pages go when it is dropped


def slot_views(mm: mmap.mmap, layout: SlotLayout, slot: int, n: int):
    """(indices (n,) int64, labels (n,) int64, images (n, C, H, W) float32) views of one slot;
    images None in a byte slot (byte_views)."""
    base = slot * layout.slot_bytes
    indices = np.ndarray((n,), np.int64, buffer=mm, offset=base)
    labels = np.ndarray((n,), np.int64, buffer=mm, offset=base + layout.labels_offset)
    if layout.byte_capacity:
        return indices, labels, None
    offset = base + layout.images_offset
    images = np.ndarray((n, *layout.shape), np.float32, buffer=mm, offset=offset)
    return indices, labels, images


def byte_views(mm: mmap.mmap, layout: SlotLayout, slot: int, n: int):
    """(offsets (n + 1,) int64, data (byte_capacity,) uint8) of one byte slot: file i of the
    batch is data[offsets[i]:offsets[i + 1]]."""
    base = slot * layout.slot_bytes + layout.images_offset
    offsets = np.ndarray((n + 1,), np.int64, buffer=mm, offset=base)
    data = np.ndarray((layout.byte_capacity,), np.uint8, buffer=mm, offset=base + 8 * (n + 1))
    return offsets, data


def _round_up(x: int, to: int) -> int:
    return -(-x // to) * to


def recv_exact(sock, n: int) -> bytes:
    """n bytes from a stream socket, or b'' if the peer closed it first."""
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = sock.recv(n - len(buf))
        except ConnectionResetError:
            return b""
        if not chunk:
            return b""
        buf += chunk
    return bytes(buf)
