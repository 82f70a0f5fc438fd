"""Copy each host batch into pinned memory in a thread, ahead of the script (hpcdl.torch.Loader).

NOTE [pinned hand-off]
Issue 48: with enough slots, a resnet50 step on an H100 still waited 25 % of its time in next(),
where DataLoader waited 0.4 %. The Loader copied each 77 MiB batch (128 x 3 x 224 x 224 float32)
from its shared-memory slot into pinned memory inside next(), on the script's thread: about 10 ms
of a 35 ms step, every step. DataLoader does that copy in its pin-memory thread, so next() only
takes a ready batch from a queue. PinnedAhead does the same: its thread runs the pool's iteration
(receiving the workers' replies and handing out slots), copies each batch into pinned memory and
queues it, up to AHEAD batches ahead (hpcdl.data.ahead). A slot goes back to the workers as soon
as its copy is done, not when the script asks for the next batch, so the slots serve the
workers, not the queue.

The pinned tensors belong to torch's pinned-memory allocator, which keeps a block until the
asynchronous copies from it have finished, so a script may keep a batch as long as it likes.
Errors of the iteration (a dead worker, a bad sample) reach the script at the batch where they
happened. Closing stops the thread at its next batch and closes the iteration in that thread.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from hpcdl.data.ahead import Ahead

AHEAD = 2  # pinned batches queued for the script: one it may take now, one being replaced


class PinnedAhead:
    """Iterate (images, labels) NumPy host batches as pinned torch tensors, copied in a thread.

    host: a generator of (images (B, C, H, W) float32, labels (B,) int64) views, valid until the
    next item (a loader slot); it runs, and is closed, in the thread."""

    def __init__(self, host: Iterable, torch: Any) -> None:
        self.host = host
        self.torch = torch

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        from_numpy = self.torch.from_numpy

        def pin(batch: tuple[Any, Any]) -> tuple[Any, Any]:
            images, labels = batch
            return from_numpy(images).pin_memory(), from_numpy(labels).pin_memory()

        return iter(Ahead(self.host, pin, AHEAD, "hpcdl-pin-memory"))
