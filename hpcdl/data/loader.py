"""Loader: minibatches of a data set in sampler order, built by K worker processes (or in-process).

    loader = Loader(ds, batch_size, workers=K, seed=S, augment="crop4+flip")  # prefetch: slots
    for images, labels in loader.iterate(batches, epoch, train=True):
        ...  # images (B, C, H, W) float32, labels (B,) int64: valid until the next iteration

Results depend only on (data, batches, epoch, seed, augment, train), never on K.

A stalled worker ends an iteration with LoaderTimeout after `timeout_s` (hpcdl.data.pool). A
caller that must stop anyway (Slurm's SIGTERM, and a checkpoint to write) passes
`stop_requested`: once it answers True while the loader waits, the workers are closed and the
remaining batches are built in the calling process, bitwise the same as the workers' would be.

NOTE [default slots]
A worker can only build a batch into a free slot, and the trainer holds one slot while it uses a
batch. With fewer slots than workers, the rest sit idle (issue 48: the old default of 4 slots
fed 8 workers at 0.30x DataLoader's rate). So `prefetch=None` gives SLOTS_PER_WORKER slots per
worker (DataLoader's prefetch_factor 2: one batch being built, one ready), at least MIN_SLOTS,
within a memory bound: one rank's slots take at most SLOT_MEMORY_BYTES (4 GiB) and at most
SHM_SHARE (a quarter) of the free shared memory split over the node's ranks; never fewer than
2 slots. A batch of 128 rrc224 float32 images is a 77 MiB slot: 15 workers take 30 slots, 2.3
GiB. Where the bound leaves fewer slots than workers, `slot_warning` says so (the start line,
hpcdl doctor). An explicit prefetch is taken as given.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from hpcdl.data.augment import parse_augment
from hpcdl.data.batch import BatchBuilder, check_augment, output_shape
from hpcdl.data.dataset import Locate
from hpcdl.data.file_bytes import FileBytesReader, byte_capacity, check_gpu_decode
from hpcdl.data.gpu_decode import GpuBatchDecoder
from hpcdl.data.slots import SlotLayout, free_bytes, shm_dir

if TYPE_CHECKING:
    from hpcdl.data.pool import Upcoming
    from hpcdl.data.worker_cores import WorkerCores

# How long a worker may stay silent on a batch the trainer waits for (--loader-timeout): well
# above a slow parallel file system read (tens of seconds) or a Lustre/GPFS server failover
# (minutes), as long as the default collective timeout of torch.distributed with NCCL.
LOADER_TIMEOUT_S = 600.0

SLOTS_PER_WORKER = 2
MIN_SLOTS = 4
SLOT_MEMORY_BYTES = 4 << 30
SHM_SHARE = 4  # the default slots take at most 1/SHM_SHARE of the free shared memory


def default_workers(cores_per_node: int | None = None, ranks_per_node: int = 1) -> int:
    """A fair share of the node's cores per rank, leaving one for the rank itself (>= 1)."""
    cores = cores_per_node or len(os.sched_getaffinity(0)) or os.cpu_count() or 1
    return max(1, cores // max(1, ranks_per_node) - 1)


def default_slots(
    workers: int, slot_bytes: int, shm_free: int | None = None, ranks_per_node: int = 1
) -> int:
    """Batch slots for `workers` workers when the user gave none (NOTE [default slots]).

    slot_bytes: one slot's size; shm_free: free bytes of the shared-memory directory (None:
    measured now); ranks_per_node: the ranks that share it."""
    if shm_free is None:
        shm_free = free_bytes(shm_dir())
    wanted = max(MIN_SLOTS, SLOTS_PER_WORKER * workers)
    budget = min(SLOT_MEMORY_BYTES, shm_free // (SHM_SHARE * max(1, ranks_per_node)))
    return max(2, min(wanted, budget // max(1, slot_bytes)))


def slot_warning(workers: int, slots: int) -> str | None:
    """One line where `slots` batch slots leave some of `workers` workers idle, else None."""
    if workers == 0 or slots >= workers:
        return None
    return (
        f"{slots} batch slots for {workers} loader workers: at most {slots - 1} workers can "
        f"build batches while the trainer holds one slot; give --prefetch "
        f"{SLOTS_PER_WORKER * workers} (more shared memory: HPCDL_SHM_DIR, --shm-size) or "
        "fewer --workers"
    )


class Loader:
    """Minibatches in sampler order, built by `workers` processes into shared-memory slots.

    prefetch: batch slots (None: NOTE [default slots]; the count used is `slots`, and
    `slots_default` says whether it was the default). workers=0 builds in this process.
    cores: where the workers run (hpcdl.data.worker_cores; None: where this process does)."""

    def __init__(
        self,
        ds,
        batch_size: int,
        workers: int = 0,
        prefetch: int | None = None,
        seed: int = 0,
        augment: str | None = "none",
        locate: Locate | None = None,
        skip_bad_samples: bool = False,
        timeout_s: float = LOADER_TIMEOUT_S,
        ranks_per_node: int = 1,
        decode: str = "cpu",
        xp: Any = np,
        cores: WorkerCores | None = None,
    ) -> None:
        if decode not in ("cpu", "gpu"):
            raise ValueError(f"decode must be cpu or gpu, got {decode!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if workers < 0:
            raise ValueError(f"workers must be >= 0, got {workers}")
        if prefetch is not None and prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s}")
        self.ds, self.batch_size, self.workers = ds, batch_size, workers
        self.cores = cores
        self.aug = parse_augment(augment)
        check_augment(ds, self.aug)
        self.sample_shape = output_shape(ds, self.aug)  # (C, H, W) of delivered images
        self._build_args = (seed, locate, skip_bad_samples)
        self.decode = decode
        self._gpu = None  # decode gpu: byte slots decoded here (hpcdl.data.gpu_decode)
        capacity = 0
        if decode == "gpu":
            check_gpu_decode(ds)
            capacity = byte_capacity(ds, batch_size)
            self._gpu = GpuBatchDecoder(ds, self.aug, seed, xp, skip_bad=skip_bad_samples)
        self._layout = SlotLayout(1, batch_size, self.sample_shape, capacity)
        self._pool = None
        self._builder = None  # builds in this process: workers=0, or after a stop request
        self.slots_default = prefetch is None
        self.slots = 0 if workers == 0 else prefetch or self._default_slots(ranks_per_node)
        if workers == 0:
            self._build_here()
        else:
            from hpcdl.data.pool import WorkerOptions, WorkerPool  # noqa: PLC0415

            layout = dataclasses.replace(self._layout, count=self.slots)
            options = WorkerOptions(workers, seed, augment or "none", locate, skip_bad_samples,
                                    timeout_s, cores.cores if cores else None)  # fmt: skip
            self._pool = WorkerPool(ds, layout, options)

    def _default_slots(self, ranks_per_node: int) -> int:
        one = self._layout.slot_bytes
        return default_slots(self.workers, one, ranks_per_node=ranks_per_node)

    def _build_here(self) -> None:
        self._labels = np.empty(self.batch_size, np.int64)
        if self._gpu is not None:
            seed, locate, skip_bad = self._build_args
            self._builder = FileBytesReader(self.ds, locate, skip_bad)
            self._offsets = np.empty(self.batch_size + 1, np.int64)
            self._images = np.empty(self._layout.byte_capacity, np.uint8)  # the files' bytes
            return
        self._builder = BatchBuilder(self.ds, self.aug, *self._build_args)
        self._images = np.empty((self.batch_size, *self.sample_shape), np.float32)

    def iterate(
        self,
        batches,
        epoch: int,
        train: bool = True,
        stop_requested: Callable[[], bool] | None = None,
        then: Upcoming | None = None,
    ):
        """Yield (images (n, C, H, W) float32, labels (n,) int64) for each batch of indices.

        The arrays are views of a buffer the loader reuses: valid until the next iteration
        (decode gpu: images are new arrays of the xp given, labels NumPy).
        stop_requested: see the module notes (polled only while waiting for a worker).
        then: what the next iterate() will be asked for, so that the workers go on into it
        while this one's last batches are used (hpcdl.data.pool NOTE [the next epoch])."""
        batches = list(batches)
        for b in batches + (list(then.batches) if then is not None else []):
            if not 0 < len(b) <= self.batch_size:
                raise ValueError(
                    f"a batch of {len(b)} samples does not fit batch_size {self.batch_size}"
                )
        host = self._host_batches(batches, epoch, train, stop_requested, then)
        if self._gpu is None:
            return (yield from host)
        decoded = iter(self._gpu.ahead(batches, host, epoch, train))  # one batch ahead
        try:
            yield from decoded
        finally:
            decoded.close()  # the thread stops and closes host
            host.close()

    def _host_batches(self, batches: list, epoch: int, train: bool, stop_requested, then):
        """The batches as the workers (or this process) build them: pixels, or byte slots."""
        if self._builder is None:
            delivered = yield from self._pool.iterate(batches, epoch, train, stop_requested, then)
            if delivered == len(batches):
                return
            self._build_here()  # the pool closed itself; this loader builds from now on
            batches = batches[delivered:]
        for b in batches:
            n, b = len(b), np.asarray(b, np.int64)
            if self._gpu is not None:
                self._builder.read(b, self._labels, self._offsets, self._images)
                yield (self._offsets[: n + 1], self._images), self._labels[:n]
                continue
            self._builder.build(b, epoch, train, self._images, self._labels)
            yield self._images[:n], self._labels[:n]

    @property
    def decoder_name(self) -> str | None:
        """The decoder of --decode gpu (nvimgcodec, pillow), None with decode cpu."""
        return None if self._gpu is None else self._gpu.decoder.name

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._pool.procs] if self._pool is not None else []

    def stats(self) -> dict:
        """{"bad_samples", "local_reads", "pfs_reads"} so far, plus control-channel traffic."""
        out = dict(bad_samples=0, local_reads=0, pfs_reads=0, control_bytes=0, control_messages=0)
        if self._pool is not None:
            out.update(self._pool.counts)
            out["control_bytes"] = self._pool.control_bytes
            out["control_messages"] = self._pool.control_messages
        if self._builder is not None:
            c = self._builder.counts
            out["bad_samples"] += c.bad
            out["local_reads"] += c.local
            out["pfs_reads"] += c.pfs
        if self._gpu is not None:
            out["bad_samples"] += self._gpu.bad
            out["decode_cpu_fallbacks"] = self._gpu.cpu_fallbacks
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
        if self._builder is not None:
            self._builder.reader.close()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
