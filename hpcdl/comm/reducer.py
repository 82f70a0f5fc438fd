"""GradientReducer: average a flat gradient buffer across ranks, bucket by bucket, during backward.

The buffer is cut into fixed buckets (a small first one, then `bucket_mb` each) from offset 0
upwards. Backward makes gradients final from the front of the buffer (see hpcdl.nn's layout), so
`mark_ready(n)` hands every bucket that lies inside [0, n) to a communication thread, which runs a
blocking MPI Allreduce on it while backward goes on. mpi4py releases the GIL inside MPI calls, so
the thread overlaps with NumPy/CuPy work. Every rank reduces the same buckets in the same order
on its own duplicate of the communicator, so no other collective can interleave with them.

GPU buffers: with a CUDA-aware MPI the bucket (a CuPy view) goes to MPI directly after the
compute stream has reached the point where it was marked ready (an event, not a device-wide
sync). Otherwise each bucket is copied to a pinned host buffer, reduced there and copied back.
Open MPI's non-blocking collectives are not CUDA-aware, hence the thread and blocking calls.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from hpcdl.backend import array_module, pinned_empty

FIRST_BUCKET_BYTES = 1 << 20  # like PyTorch DDP: start communicating early


@dataclass(frozen=True)
class Bucket:
    index: int
    lo: int  # element offsets into the flat buffer
    hi: int


def plan_buckets(num_elements: int, itemsize: int, bucket_mb: float) -> list[Bucket]:
    """Bucket boundaries: first min(1 MiB, bucket_mb), then bucket_mb each (last may be short)."""
    if bucket_mb <= 0:
        raise ValueError(f"bucket size must be positive, got {bucket_mb} MiB")
    size = max(1, int(bucket_mb * (1 << 20)) // itemsize)
    first = max(1, min(size, FIRST_BUCKET_BYTES // itemsize))
    buckets, lo = [], 0
    while lo < num_elements:
        hi = min(num_elements, lo + (first if not buckets else size))
        buckets.append(Bucket(len(buckets), lo, hi))
        lo = hi
    return buckets


class GradientReducer:
    """Averages `grads` (numpy or cupy, contiguous, 1-D) over `comm` in buckets on a helper thread.

    Use per step: begin_step(); model.backward(..., grad_ready=reducer.mark_ready); reducer.wait().
    `host_staged=True` forces the copy-through-host path (what a non-CUDA-aware MPI needs); with
    NumPy buffers it runs the same code, the "device" copies being host copies.
    """

    def __init__(
        self, comm: Any, grads: Any, bucket_mb: float = 25.0, host_staged: bool = False
    ) -> None:
        if grads.ndim != 1:
            raise ValueError("GradientReducer needs a flat 1-D gradient buffer")
        self.grads = grads
        self.xp = array_module(grads)
        self.on_device = self.xp is not np
        self.comm = comm.Dup()
        self.world_size = self.comm.Get_size()
        self.host_staged = host_staged
        self.buckets = plan_buckets(grads.size, grads.dtype.itemsize, bucket_mb)
        self._host = pinned_empty(grads.size, grads.dtype) if host_staged else None
        self._copy_stream = self.xp.cuda.Stream(non_blocking=True) if self.on_device else None
        self._queue: queue.Queue[tuple[Bucket, Any] | None] = queue.Queue()
        self._done = threading.Semaphore(0)
        self._error: BaseException | None = None
        self._next = 0  # first bucket not yet handed to the thread
        self.last_exposed_s = 0.0
        self.last_comm_s = 0.0
        self._comm_s = 0.0
        self._thread = threading.Thread(target=self._run, name="hpcdl-allreduce", daemon=True)
        self._thread.start()

    def begin_step(self) -> None:
        self._next = 0
        self._comm_s = 0.0

    def mark_ready(self, n: int) -> None:
        """grads[:n] are final: start reducing every bucket that lies inside them."""
        while self._next < len(self.buckets) and self.buckets[self._next].hi <= n:
            event = None
            if self.on_device:
                event = self.xp.cuda.Event(disable_timing=True)
                event.record()
            self._queue.put((self.buckets[self._next], event))
            self._next += 1

    def wait(self) -> None:
        """Block until every bucket is reduced and averaged; records the exposed wait time.

        Buckets never marked ready during backward are reduced here on the calling thread,
        after the thread's buckets, so the order on the communicator stays the same on every
        rank and the tail skips a thread hand-off it could not overlap with anything anyway.
        """
        from mpi4py import MPI  # noqa: PLC0415

        start = time.perf_counter()
        handed = self._next
        for _ in range(handed):
            self._done.acquire()
        if self._error is not None:
            raise RuntimeError(f"gradient allreduce failed: {self._error}") from self._error
        t_tail = time.perf_counter()
        scale = 1.0 / self.world_size
        event = None
        if self.on_device and handed < len(self.buckets):
            event = self.xp.cuda.Event(disable_timing=True)
            event.record()
        for bucket in self.buckets[handed:]:
            self._reduce(MPI, bucket, event, scale)
        self._next = len(self.buckets)
        if self.on_device:
            self._copy_stream.synchronize()
        end = time.perf_counter()
        self.last_exposed_s = end - start
        self.last_comm_s = self._comm_s + (end - t_tail)
        self.last_unmarked = len(self.buckets) - handed

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)
        self.comm.Free()

    def _run(self) -> None:
        from mpi4py import MPI  # noqa: PLC0415

        scale = 1.0 / self.world_size
        while True:
            item = self._queue.get()
            if item is None:
                return
            bucket, event = item
            t0 = time.perf_counter()
            try:
                if self._error is None:
                    self._reduce(MPI, bucket, event, scale)
            except BaseException as exc:  # surfaced by wait() on the main thread
                self._error = exc
            self._comm_s += time.perf_counter() - t0
            self._done.release()

    def _reduce(self, MPI: Any, bucket: Bucket, event: Any, scale: float) -> None:
        view = self.grads[bucket.lo : bucket.hi]
        if event is not None:
            event.synchronize()
        if not self.host_staged:
            self.comm.Allreduce(MPI.IN_PLACE, view, op=MPI.SUM)
            view *= scale  # numpy: in place on host; cupy: on the thread's (default) stream
            if self.on_device:
                self.xp.cuda.get_current_stream().synchronize()
            return
        host = self._host[bucket.lo : bucket.hi]
        if self.on_device:
            with self._copy_stream:
                view.get(out=host, stream=self._copy_stream)
                self._copy_stream.synchronize()
        else:
            np.copyto(host, view)
        self.comm.Allreduce(MPI.IN_PLACE, host, op=MPI.SUM)
        host *= scale
        if self.on_device:
            view.set(host, stream=self._copy_stream)
        else:
            np.copyto(view, host)
