"""Loader: minibatches of a data set in sampler order, built by K worker processes (or in-process).

    loader = Loader(ds, batch_size, workers=K, prefetch=P, seed=S, augment="crop4+flip")
    for images, labels in loader.iterate(batches, epoch, train=True):
        ...  # images (B, C, H, W) float32, labels (B,) int64: valid until the next iteration

Results depend only on (data, batches, epoch, seed, augment, train), never on K.

A stalled worker ends an iteration with LoaderTimeout after `timeout_s` (hpcdl.data.pool). A
caller that must stop anyway (Slurm's SIGTERM, and a checkpoint to write) passes
`stop_requested`: once it answers True while the loader waits, the workers are closed and the
remaining batches are built in the calling process, bitwise the same as the workers' would be.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np

from hpcdl.data.augment import parse_augment
from hpcdl.data.batch import BatchBuilder, check_augment, output_shape
from hpcdl.data.dataset import Locate

# How long a worker may stay silent on a batch the trainer waits for (--loader-timeout): well
# above a slow parallel file system read (tens of seconds) or a Lustre/GPFS server failover
# (minutes), as long as the default collective timeout of torch.distributed with NCCL.
LOADER_TIMEOUT_S = 600.0


def default_workers(cores_per_node: int | None = None, ranks_per_node: int = 1) -> int:
    """A fair share of the node's cores per rank, leaving one for the rank itself (>= 1)."""
    cores = cores_per_node or len(os.sched_getaffinity(0)) or os.cpu_count() or 1
    return max(1, cores // max(1, ranks_per_node) - 1)


class Loader:
    def __init__(
        self,
        ds,
        batch_size: int,
        workers: int = 0,
        prefetch: int = 4,
        seed: int = 0,
        augment: str | None = "none",
        locate: Locate | None = None,
        skip_bad_samples: bool = False,
        timeout_s: float = LOADER_TIMEOUT_S,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if workers < 0:
            raise ValueError(f"workers must be >= 0, got {workers}")
        if prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s}")
        self.ds, self.batch_size, self.workers = ds, batch_size, workers
        self.aug = parse_augment(augment)
        check_augment(ds, self.aug)
        self.sample_shape = output_shape(ds, self.aug)  # (C, H, W) of delivered images
        self._build_args = (seed, locate, skip_bad_samples)
        self._pool = None
        self._builder = None  # builds in this process: workers=0, or after a stop request
        if workers == 0:
            self._build_here()
        else:
            from hpcdl.data.pool import WorkerOptions, WorkerPool  # noqa: PLC0415
            from hpcdl.data.slots import SlotLayout  # noqa: PLC0415

            layout = SlotLayout(prefetch, batch_size, self.sample_shape)
            options = WorkerOptions(
                workers, seed, augment or "none", locate, skip_bad_samples, timeout_s
            )
            self._pool = WorkerPool(ds, layout, options)

    def _build_here(self) -> None:
        self._builder = BatchBuilder(self.ds, self.aug, *self._build_args)
        self._images = np.empty((self.batch_size, *self.sample_shape), np.float32)
        self._labels = np.empty(self.batch_size, np.int64)

    def iterate(
        self,
        batches,
        epoch: int,
        train: bool = True,
        stop_requested: Callable[[], bool] | None = None,
    ):
        """Yield (images (n, C, H, W) float32, labels (n,) int64) for each batch of indices.

        The arrays are views of a buffer the loader reuses: valid until the next iteration.
        stop_requested: see the module notes (polled only while waiting for a worker)."""
        batches = list(batches)
        for b in batches:
            if not 0 < len(b) <= self.batch_size:
                raise ValueError(
                    f"a batch of {len(b)} samples does not fit batch_size {self.batch_size}"
                )
        if self._builder is None:
            delivered = yield from self._pool.iterate(batches, epoch, train, stop_requested)
            if delivered == len(batches):
                return
            self._build_here()  # the pool closed itself; this loader builds from now on
            batches = batches[delivered:]
        for b in batches:
            n = len(b)
            self._builder.build(np.asarray(b, np.int64), epoch, train, self._images, self._labels)
            yield self._images[:n], self._labels[:n]

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
