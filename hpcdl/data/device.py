"""GPU path: copy the next host batch to the device on its own CUDA stream while this step runs.

    for x, y in on_device(loader.iterate(batches, epoch), xp):
        ...  # x (B, C, H, W) float32 and y (B,) int64: CuPy arrays on the GPU, NumPy on the CPU

A feeder thread takes each host batch (a loader slot), copies it into a pinned staging buffer
(so the upload is truly asynchronous and the slot goes back to the loader at once) and queues
the upload on a non-blocking stream; the compute stream waits on an event, never the host. The
copy into pinned memory and the wait for the loader thus overlap the previous step too (NumPy
and CuPy release the GIL for them). Two buffers alternate: a yielded batch stays valid until
the next iteration. The CPU path does not use this module.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from hpcdl import diag
from hpcdl.backend import pinned_empty

_BUFFERS = 2
_POLL_S = 0.2  # how often a blocked feeder looks whether the consumer has gone away


def on_device(host_batches: Iterable, xp) -> Iterable:
    """The batches as the backend xp wants them: unchanged for NumPy, prefetched for CuPy."""
    return host_batches if xp is np else DevicePrefetcher(host_batches, xp)


class _Buffers:
    """Pinned host staging + device arrays for one in-flight batch."""

    def __init__(self, cp, images_shape, labels_shape) -> None:
        self.host_images = pinned_empty(images_shape, np.float32)
        self.host_labels = pinned_empty(labels_shape, np.int64)
        self.images = cp.empty(images_shape, np.float32)
        self.labels = cp.empty(labels_shape, np.int64)
        self.ready = cp.cuda.Event(disable_timing=True)  # upload finished
        self.consumed = cp.cuda.Event(disable_timing=True)  # compute on these arrays queued

    def fits(self, n: int) -> bool:
        return self.host_images.shape[0] >= n

    def upload(self, images: np.ndarray, labels: np.ndarray, stream) -> int:
        """Queue the upload of one host batch on stream; returns its size."""
        self.ready.synchronize()  # the staging buffer's previous upload has left the host
        stream.wait_event(self.consumed)  # and the device arrays' previous batch is used up
        n = len(labels)
        np.copyto(self.host_images[:n], images)
        np.copyto(self.host_labels[:n], labels)
        self.images[:n].set(self.host_images[:n], stream=stream)
        self.labels[:n].set(self.host_labels[:n], stream=stream)
        self.ready.record(stream)
        return n


class DevicePrefetcher:
    """Wrap an iterable of host (images, labels) batches; yield device batches, one ahead."""

    def __init__(self, host_batches: Iterable, cp) -> None:
        self.host_batches = host_batches
        self.cp = cp
        self.stream = cp.cuda.Stream(non_blocking=True)
        self._buffers: list[_Buffers | None] = [None] * _BUFFERS

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        filled: queue.Queue = queue.Queue()  # (buffer index, n) | ("error", exc) | None at the end
        free = threading.Semaphore(_BUFFERS)  # buffers the feeder may fill
        stop = threading.Event()
        feeder = threading.Thread(
            target=self._feed,
            args=(self.cp.cuda.Device().id, filled, free, stop),
            name="hpcdl-device-prefetch",
            daemon=True,
        )
        feeder.start()
        compute = self.cp.cuda.get_current_stream()
        try:
            while True:
                with diag.span(diag.Kind.DATA_WAIT):  # the step's wait (the feeder's: not)
                    item = filled.get()
                if item is None:
                    return
                if item[0] == "error":
                    raise item[1]
                k, n = item
                buf = self._buffers[k]
                compute.wait_event(buf.ready)
                yield buf.images[:n], buf.labels[:n]
                buf.consumed.record(compute)  # work queued on these arrays precedes this point
                free.release()
        finally:
            stop.set()
            free.release()  # a feeder waiting for a buffer wakes up and sees stop
            feeder.join()

    def _feed(self, device_id: int, filled: queue.Queue, free, stop: threading.Event) -> None:
        self.cp.cuda.Device(device_id).use()  # the current device is per thread
        batches = iter(self.host_batches)
        try:
            for k, (images, labels) in enumerate(batches):
                while not free.acquire(timeout=_POLL_S):
                    if stop.is_set():
                        return
                if stop.is_set():
                    return
                slot = k % _BUFFERS
                buf = self._buffers[slot]
                if buf is None or not buf.fits(len(labels)):  # the consumer keeps the old alive
                    buf = self._buffers[slot] = _Buffers(self.cp, images.shape, labels.shape)
                filled.put((slot, buf.upload(images, labels, self.stream)))
            filled.put(None)
        except BaseException as exc:  # a loader error (dead worker, bad sample) reaches the step
            filled.put(("error", exc))
        finally:
            close = getattr(batches, "close", None)
            if close is not None:
                close()  # a generator's cleanup (the loader draining its workers) runs here
