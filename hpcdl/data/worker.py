"""Loader worker process: `python -m hpcdl.data.worker SOCKET_FD SHM_FD` (started by WorkerPool).

Receives one pickled configuration at start, then only fixed-size TASK messages; builds each
minibatch straight into its shared-memory slot and answers with a fixed-size REPLY. Exits when
told to stop or when the training process goes away (end of file on the socket); ignores
SIGINT, SIGTERM and SIGUSR1, which are the training process's to act on.
"""

from __future__ import annotations

import mmap
import os
import pickle
import socket
import sys
import traceback

from hpcdl import stop_signals
from hpcdl.data.augment import parse_augment
from hpcdl.data.batch import BatchBuilder
from hpcdl.data.dataset import DataError
from hpcdl.data.file_bytes import FileBytesReader
from hpcdl.data.kinds import reopen
from hpcdl.data.slots import (
    OP_DATA_ERROR,
    OP_DONE,
    OP_FAILED,
    OP_READY,
    OP_STOP,
    REPLY,
    TASK,
    byte_views,
    recv_exact,
    slot_views,
)


def _reply(sock, op: int, slot=0, batch=0, counts=(0, 0, 0), text: str = "") -> None:
    data = text.encode()
    sock.sendall(REPLY.pack(op, slot, batch, *counts, len(data)) + data)


def main(argv: list[str]) -> int:
    # Ctrl-C reaches the whole process group, and Slurm's time-limit SIGTERM/SIGUSR1 every
    # process of the job step: the training process decides (it may still need batches to
    # reach a checkpoint), workers follow; they exit on STOP or on end of file. The pool
    # started this process with them blocked (NOTE [stop signals] in hpcdl/stop_signals.py).
    stop_signals.ignore()
    sock = socket.socket(fileno=int(argv[0]))
    shm_fd = int(argv[1])
    header = recv_exact(sock, 8)
    if not header:
        return 0
    cfg = pickle.loads(recv_exact(sock, int.from_bytes(header, "little")))
    layout = cfg["layout"]  # the pool's SlotLayout: the same offsets on both sides
    mm = mmap.mmap(shm_fd, layout.total_bytes)
    os.close(shm_fd)
    try:
        ds = reopen(cfg["dataset"])  # the index the pool read, not a new one
        if layout.byte_capacity:  # --decode gpu: files into byte slots, the rank decodes
            builder = FileBytesReader(ds, cfg["locate"], cfg["skip_bad"])
        else:
            builder = BatchBuilder(
                ds, parse_augment(cfg["augment"]), cfg["seed"], cfg["locate"], cfg["skip_bad"]
            )
    except Exception as exc:  # reported to the training process, which raises it
        _reply(sock, _error_op(exc), text=_describe(exc))
        return 1
    _reply(sock, OP_READY)
    last = (0, 0, 0)
    while True:
        msg = recv_exact(sock, TASK.size)
        if not msg:
            return 0
        op, slot, epoch, batch, n, train = TASK.unpack(msg)
        if op == OP_STOP:
            return 0
        indices, labels, images = slot_views(mm, layout, slot, n)
        try:
            if images is None:
                builder.read(indices.copy(), labels, *byte_views(mm, layout, slot, n))
            else:
                builder.build(indices.copy(), epoch, bool(train), images, labels)
        except Exception as exc:
            _reply(sock, _error_op(exc), slot, batch, text=_describe(exc))
            continue
        c = builder.counts
        now = (c.local, c.pfs, c.bad)
        _reply(sock, OP_DONE, slot, batch, tuple(a - b for a, b in zip(now, last)))
        last = now


def _error_op(exc: BaseException) -> int:
    return OP_DATA_ERROR if isinstance(exc, DataError) else OP_FAILED


def _describe(exc: BaseException) -> str:
    if isinstance(exc, DataError):
        return str(exc)
    return f"loader worker {os.getpid()} failed:\n" + "".join(traceback.format_exception(exc))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
