"""Work on a stream of batches in a thread, a fixed number of batches ahead of the consumer.

Two users: hpcdl.torch's pinned copies (NOTE [pinned hand-off] in hpcdl/torch/pinning.py) and
`--decode gpu`'s decode one batch ahead (NOTE [GPU decode] in hpcdl/data/gpu_decode.py). The
thread runs the source iteration itself (for a loader: receiving the workers' replies and
handing slots back), applies `work` to each item and queues the result, at most `depth` ahead.
A source item may be a view that the next item overwrites (a loader slot): `work` must copy what
it keeps. Errors of the source or of `work` reach the consumer at the item where they happened.
When the consumer leaves, the thread stops at its next item and closes the source in its own
thread (a generator's clean-up, such as the pool draining its workers, runs there).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from hpcdl import diag

_POLL_S = 0.2  # how often a thread blocked on a full queue looks whether the consumer has left
_END = object()


class Ahead:
    """Iterate work(item) for the items of source, computed in a thread `depth` items ahead.

    on_take(result), if given, runs in the consumer's thread as it takes each result and returns
    what the consumer gets (a GPU result: make the consumer's stream wait for it)."""

    def __init__(
        self,
        source: Iterable,
        work: Callable[[Any], Any],
        depth: int,
        name: str,
        on_take: Callable[[Any], Any] | None = None,
    ) -> None:
        self.source, self.work, self.depth, self.name = source, work, depth, name
        self.on_take = on_take

    def __iter__(self) -> Iterator[Any]:
        ready: queue.Queue = queue.Queue(self.depth)
        stop = threading.Event()
        thread = threading.Thread(target=self._run, args=(ready, stop), name=self.name, daemon=True)
        thread.start()
        try:
            while True:
                with diag.span(diag.Kind.DATA_WAIT):
                    item = ready.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item if self.on_take is None else self.on_take(item)
        finally:
            stop.set()
            while thread.is_alive():  # a put blocked on a full queue wakes within _POLL_S
                thread.join(_POLL_S)

    def _run(self, ready: queue.Queue, stop: threading.Event) -> None:
        source = iter(self.source)
        try:
            for item in source:
                if not _put(ready, self.work(item), stop):
                    return
            _put(ready, _END, stop)
        except BaseException as exc:  # a loader error reaches the consumer at its batch
            _put(ready, exc, stop)
        finally:
            close = getattr(source, "close", None)
            if close is not None:
                close()


def _put(ready: queue.Queue, item: Any, stop: threading.Event) -> bool:
    """Queue item unless the consumer left first (False)."""
    while not stop.is_set():
        try:
            ready.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False
