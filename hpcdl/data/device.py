"""GPU path: copy the next host batch to the device on its own CUDA stream while this step runs.

    batches = DevicePrefetcher(loader.iterate(batches, epoch), cupy)
    for x, y in batches:      # x (B, C, H, W) float32 and y (B,) int64 CuPy arrays
        ...

The host batch (a loader slot) is copied into a pinned staging buffer (so the copy to the device
is truly asynchronous and the slot can go back to the loader at once), then uploaded on a
separate non-blocking stream; the compute stream waits on an event, not on the host. Two device
buffers alternate: a yielded batch stays valid until the iteration after next. The CPU path does
not use this module.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np


def on_device(host_batches: Iterable, xp) -> Iterable:
    """The batches as the backend xp wants them: unchanged for NumPy, prefetched for CuPy."""
    return host_batches if xp is np else DevicePrefetcher(host_batches, xp)


class _Buffers:
    """Pinned host staging + device arrays for one in-flight batch."""

    def __init__(self, cp, images_shape, labels_shape) -> None:
        self.host_images = _pinned(cp, images_shape, np.float32)
        self.host_labels = _pinned(cp, labels_shape, np.int64)
        self.images = cp.empty(images_shape, np.float32)
        self.labels = cp.empty(labels_shape, np.int64)
        self.ready = cp.cuda.Event(disable_timing=True)  # upload finished
        self.consumed = cp.cuda.Event(disable_timing=True)  # compute on these arrays queued

    def upload(self, images: np.ndarray, labels: np.ndarray, stream) -> tuple[Any, Any]:
        self.ready.synchronize()  # the staging buffer's previous upload has left the host
        stream.wait_event(self.consumed)  # and the device arrays' previous batch is used up
        n = len(labels)
        np.copyto(self.host_images[:n], images)
        np.copyto(self.host_labels[:n], labels)
        self.images[:n].set(self.host_images[:n], stream=stream)
        self.labels[:n].set(self.host_labels[:n], stream=stream)
        self.ready.record(stream)
        return self.images[:n], self.labels[:n]


def _pinned(cp, shape, dtype) -> np.ndarray:
    count = int(np.prod(shape))
    mem = cp.cuda.alloc_pinned_memory(max(count * np.dtype(dtype).itemsize, 1))
    return np.frombuffer(mem, dtype, count).reshape(shape)


class DevicePrefetcher:
    """Wrap an iterable of host (images, labels) batches; yield device batches, one ahead."""

    def __init__(self, host_batches: Iterable, cp) -> None:
        self.host_batches = host_batches
        self.cp = cp
        self.stream = cp.cuda.Stream(non_blocking=True)
        self._buffers: list[_Buffers] = []

    def _buffer(self, k: int, images: np.ndarray, labels: np.ndarray) -> _Buffers:
        if len(self._buffers) < 2:
            self._buffers.append(_Buffers(self.cp, images.shape, labels.shape))
        buf = self._buffers[k % 2]
        if buf.host_images.shape[0] < len(labels):
            buf = self._buffers[k % 2] = _Buffers(self.cp, images.shape, labels.shape)
        return buf

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        pending = None
        for k, (images, labels) in enumerate(self.host_batches):
            buf = self._buffer(k, images, labels)
            arrays = buf.upload(images, labels, self.stream)  # overlaps the step on `pending`
            if pending is not None:
                yield from self._hand_over(*pending)
            pending = (buf, arrays)
        if pending is not None:
            yield from self._hand_over(*pending)

    def _hand_over(self, buf: _Buffers, arrays: tuple[Any, Any]):
        compute = self.cp.cuda.get_current_stream()
        compute.wait_event(buf.ready)
        yield arrays
        buf.consumed.record(compute)  # work queued on these arrays precedes this point
