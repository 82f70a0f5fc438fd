"""Copy each host batch into pinned memory in a thread, ahead of the script (hpcdl.torch.Loader).

NOTE [pinned hand-off]
Issue 48: with enough slots, a resnet50 step on an H100 still waited 25 % of its time in next(),
where DataLoader waited 0.4 %. The Loader copied each 77 MiB batch (128 x 3 x 224 x 224 float32)
from its shared-memory slot into pinned memory inside next(), on the script's thread: about 10 ms
of a 35 ms step, every step. DataLoader does that copy in its pin-memory thread, so next() only
takes a ready batch from a queue. PinnedAhead does the same: its thread runs the pool's iteration
(receiving the workers' replies and handing out slots), copies each batch into pinned memory and
queues it, up to AHEAD batches ahead. A slot goes back to the workers as soon as its copy is done,
not when the script asks for the next batch, so the slots serve the workers, not the queue.

The pinned tensors belong to torch's pinned-memory allocator, which keeps a block until the
asynchronous copies from it have finished, so a script may keep a batch as long as it likes.
Errors of the iteration (a dead worker, a bad sample) reach the script at the batch where they
happened. Closing stops the thread at its next batch and closes the iteration in that thread.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from hpcdl import diag

AHEAD = 2  # pinned batches queued for the script: one it may take now, one being replaced
_POLL_S = 0.2  # how often a thread blocked on a full queue looks whether the script has left
_END = object()


class PinnedAhead:
    """Iterate (images, labels) NumPy host batches as pinned torch tensors, copied in a thread.

    host: a generator of (images (B, C, H, W) float32, labels (B,) int64) views, valid until the
    next item (a loader slot); it runs, and is closed, in the thread."""

    def __init__(self, host: Iterable, torch: Any) -> None:
        self.host = host
        self.torch = torch

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        ready: queue.Queue = queue.Queue(AHEAD)
        stop = threading.Event()
        thread = threading.Thread(
            target=self._copy, args=(ready, stop), name="hpcdl-pin-memory", daemon=True
        )
        thread.start()
        try:
            while True:
                with diag.span(diag.Kind.DATA_WAIT):
                    item = ready.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()
            while thread.is_alive():  # a put blocked on a full queue wakes within _POLL_S
                thread.join(_POLL_S)

    def _copy(self, ready: queue.Queue, stop: threading.Event) -> None:
        from_numpy = self.torch.from_numpy
        batches = iter(self.host)
        try:
            for images, labels in batches:
                item: Any = (from_numpy(images).pin_memory(), from_numpy(labels).pin_memory())
                if not _put(ready, item, stop):
                    return
            _put(ready, _END, stop)
        except BaseException as exc:  # a loader error reaches the script at its batch
            _put(ready, exc, stop)
        finally:
            close = getattr(batches, "close", None)
            if close is not None:
                close()  # the pool drains its workers' batches in flight here


def _put(ready: queue.Queue, item: Any, stop: threading.Event) -> bool:
    """Queue item unless the script left first (False)."""
    while not stop.is_set():
        try:
            ready.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False
