"""GradientReducer: average a flat gradient buffer across ranks, bucket by bucket, during backward.

The buffer is cut into fixed buckets (a small first one, then `bucket_mb` each) from offset 0
upwards. Backward makes gradients final from the front of the buffer (see hpcdl.nn's layout), so
`mark_ready(n)` hands every bucket that lies inside [0, n) to a communication thread, which runs a
blocking MPI Allreduce on it while backward goes on. mpi4py releases the GIL inside MPI calls, so
the thread overlaps with NumPy/CuPy work. Every rank reduces the same buckets in the same order
on its own duplicate of the communicator, so no other collective can interleave with them.

GPU buffers: with a CUDA-aware MPI the bucket (a CuPy view) goes to MPI directly once an event,
recorded on the compute stream when backward marked the bucket ready (so after the kernels that
wrote its gradients), has completed: never a wait on the whole default stream or the device.
Anything the reducer launches itself runs on its own non-blocking stream, which wait()
synchronizes. Without a CUDA-aware MPI each bucket is copied to a pinned host buffer, reduced
there and copied back.
Open MPI's non-blocking collectives are not CUDA-aware, hence the thread and blocking calls.

The helper thread calls MPI while the training thread may too (failure notices, the stop
agreement), which needs MPI_THREAD_MULTIPLE; hpcdl.comm.world asks for it. An MPI that grants
less gets no helper thread: wait() reduces every bucket on the calling thread after backward
(no overlap, same results), and init_world says so once.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from hpcdl import diag
from hpcdl.backend import array_module, pinned_empty
from hpcdl.mpi_threads import thread_multiple

FIRST_BUCKET_BYTES = 1 << 20  # like PyTorch DDP: start communicating early


@dataclass(frozen=True)
class Bucket:
    index: int
    lo: int  # element offsets into the flat buffer
    hi: int


def plan_buckets(num_elements: int, itemsize: int, bucket_mb: float) -> list[Bucket]:
    """Bucket boundaries: first min(1 MiB, bucket_mb), then bucket_mb each; the last may be
    shorter, or up to a quarter of the first longer (a sliver is merged into it)."""
    if bucket_mb <= 0:
        raise ValueError(f"bucket size must be positive, got {bucket_mb} MiB")
    size = max(1, int(bucket_mb * (1 << 20)) // itemsize)
    first = max(1, min(size, FIRST_BUCKET_BYTES // itemsize))
    bounds, lo = [], 0
    while lo < num_elements:
        hi = min(num_elements, lo + (first if not bounds else size))
        bounds.append((lo, hi))
        lo = hi
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] < first // 4:
        # a sliver at the end costs a whole allreduce's latency for nothing: merge it
        bounds[-2:] = [(bounds[-2][0], bounds[-1][1])]
    return [Bucket(i, lo, hi) for i, (lo, hi) in enumerate(bounds)]


class GradientReducer:
    """Averages `grads` (numpy or cupy, contiguous, 1-D) over `comm` in buckets on a helper thread.

    Use per step: begin_step(); model.backward(..., grad_ready=reducer.mark_ready); reducer.wait().
    `host_staged=True` forces the copy-through-host path (what a non-CUDA-aware MPI needs); with
    NumPy buffers it runs the same code, the "device" copies being host copies.

    Ordering: ready buckets wait in a FIFO; whoever holds the reduce lock, the helper thread
    during backward or the caller inside wait(), takes the next one. So the buckets are reduced
    one at a time in bucket order on every rank, and a bucket the helper has not picked up by
    the time backward ends costs no thread wake-up (~40 us each on a loaded node).
    """

    def __init__(
        self,
        comm: Any,
        grads: Any,
        bucket_mb: float = 25.0,
        host_staged: bool = False,
        prescaled: bool = False,
        host_sum: Any = None,
    ) -> None:
        if grads.ndim != 1:
            raise ValueError("GradientReducer needs a flat 1-D gradient buffer")
        self.grads = grads
        self.xp = array_module(grads)
        self.on_device = self.xp is not np
        self.comm = comm.Dup()
        self.world_size = self.comm.Get_size()
        self.host_staged = host_staged
        # prescaled: the caller computed the gradients of loss / world size (backward is linear
        # in the loss gradient), so the sum is already the average and no pass over the
        # buffer is needed; that pass costs as much as a third of a small model's allreduce.
        self.scale = None if prescaled else 1.0 / self.world_size
        # host_sum: an MPI op that sums host buffers of this dtype faster than MPI.SUM (hpcdl.torch
        # gives one for float16); device buffers always use MPI.SUM.
        self.host_sum = host_sum
        self.buckets = plan_buckets(grads.size, grads.dtype.itemsize, bucket_mb)
        self._host = pinned_empty(grads.size, grads.dtype) if host_staged else None
        self._device_id = self.xp.cuda.Device().id if self.on_device else None
        self._copy_stream = self.xp.cuda.Stream(non_blocking=True) if self.on_device else None
        self._ready: deque[tuple[Bucket, Any]] = deque()  # marked, not yet taken
        self._reduce_lock = threading.Lock()  # held while taking and reducing one bucket
        self._wakeups: queue.SimpleQueue[bool] = queue.SimpleQueue()  # False: shut down
        self._error: BaseException | None = None
        self._next = 0  # first bucket not yet marked ready
        self._unwoken = 0  # ready buckets the helper thread has not been woken for
        self.threaded = thread_multiple()  # False: wait() reduces every bucket itself
        self._thread: threading.Thread | None = None
        if self.threaded:
            self._thread = threading.Thread(target=self._run, name="hpcdl-allreduce", daemon=True)
            self._thread.start()

    def begin_step(self) -> None:
        self._next = 0
        self._unwoken = 0

    def mark_ready(self, n: int) -> None:
        """grads[:n] are final: every bucket inside them is ready to be reduced.

        The helper thread is woken for a ready bucket at the next mark, i.e. once backward has
        moved on: a bucket that becomes ready at the very end of backward is reduced by wait()
        on the calling thread and costs no wake-up (tens of microseconds on a busy node, as
        much as a third of a 1 MB allreduce)."""
        if self.threaded:
            for _ in range(self._unwoken):
                self._wakeups.put(True)
        self._unwoken = 0
        while self._next < len(self.buckets) and self.buckets[self._next].hi <= n:
            event = None
            if self.on_device:
                event = self.xp.cuda.Event(disable_timing=True)
                event.record()
            self._ready.append((self.buckets[self._next], event))
            self._next += 1
            self._unwoken += 1

    def wait(self) -> None:
        """Block until every bucket is reduced and averaged.

        The caller reduces what the helper has not taken yet (buckets marked late, and those
        never marked during backward), in bucket order, after the helper's current bucket.
        """
        if self._next < len(self.buckets):  # on a GPU: reduced after an event recorded here
            self.mark_ready(self.grads.size)
        self._unwoken = 0  # the caller reduces these itself
        while self._take_and_reduce():
            pass
        with self._reduce_lock:  # the helper's bucket in flight, if any, is done after this
            pass
        if self._error is not None:
            raise RuntimeError(f"gradient allreduce failed: {self._error}") from self._error
        if self.on_device:
            self._copy_stream.synchronize()

    def close(self) -> None:
        if self._thread is not None:
            self._wakeups.put(False)
            self._thread.join(timeout=5)
        self.comm.Free()

    def _take_and_reduce(self) -> bool:
        """Reduce the oldest ready bucket, if any; False when none was waiting."""
        from mpi4py import MPI  # noqa: PLC0415

        with self._reduce_lock:
            if not self._ready:
                return False
            bucket, event = self._ready.popleft()
            try:
                if self._error is None:
                    t0 = time.perf_counter()
                    self._reduce(MPI, bucket, event)
                    nbytes = (bucket.hi - bucket.lo) * self.grads.dtype.itemsize
                    diag.record_aside(diag.Kind.ALLREDUCE, t0, time.perf_counter(), nbytes)
            except BaseException as exc:  # surfaced by wait() on the main thread
                self._error = exc
            return True

    def _run(self) -> None:
        if self.on_device:
            self.xp.cuda.Device(self._device_id).use()  # the current device is per thread
        while self._wakeups.get():
            self._take_and_reduce()

    def _reduce(self, MPI: Any, bucket: Bucket, event: Any) -> None:
        view = self.grads[bucket.lo : bucket.hi]
        if event is not None:
            event.synchronize()
        host_sum = self.host_sum or MPI.SUM
        if not self.host_staged:
            # Blocking: when it returns, the bucket holds the sum (CUDA-aware MPI included).
            self.comm.Allreduce(MPI.IN_PLACE, view, op=MPI.SUM if self.on_device else host_sum)
            if self.scale is not None and self.on_device:
                with self._copy_stream:  # the reducer's own stream; wait() synchronizes it
                    view *= self.scale
            elif self.scale is not None:
                view *= self.scale
            return
        host = self._host[bucket.lo : bucket.hi]
        if self.on_device:
            with self._copy_stream:
                view.get(out=host, stream=self._copy_stream)
                self._copy_stream.synchronize()
        else:
            np.copyto(host, view)
        self.comm.Allreduce(MPI.IN_PLACE, host, op=host_sum)
        if self.scale is not None:
            host *= self.scale
        if self.on_device:
            view.set(host, stream=self._copy_stream)
        else:
            np.copyto(view, host)
