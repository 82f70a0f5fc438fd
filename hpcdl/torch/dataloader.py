"""hpcdl's sample order and per-sample work for torch's own DataLoader: the comparison path.

    sampler = HpcdlSampler(len(ds), batch_size, rank, world, seed=0)
    loader = DataLoader(HpcdlSamples(data), batch_size, sampler=sampler, num_workers=K)
    sampler.set_epoch(epoch)

With these a DataLoader yields the batches hpcdl.torch.Loader yields, bitwise: the sampler hands
out hpcdl's DistributedSampler order (this rank's full batches of the epoch, the last partial
one dropped) as (epoch, index) pairs, and the data set builds each sample with hpcdl's
BatchBuilder, whose crops and flips are a function of (seed, epoch, index) only. So a script
switched between the two trains to the same parameters (examples/torch_ddp.py, tests). It is
not what makes hpcdl fast: the decode is the same, the pipeline is torch's (one sample per
call, pickled to the trainer, collated), reading the data in place.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from hpcdl.data.augment import parse_augment
from hpcdl.data.batch import BatchBuilder, output_shape
from hpcdl.data.kinds import open_dataset
from hpcdl.data.sampler import DistributedSampler


class HpcdlSampler:
    """A torch Sampler (duck-typed: __iter__, __len__, set_epoch) of (epoch, index) pairs."""

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: str = "global",
    ) -> None:
        self.sampler = DistributedSampler(num_samples, world_size, rank, seed, shuffle)
        self.batch_size = batch_size
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.sampler.steps_per_epoch(self.batch_size) * self.batch_size

    def __iter__(self) -> Iterator[tuple[int, int]]:
        for batch in self.sampler.batches(self.epoch, self.batch_size):
            for index in batch:
                yield self.epoch, int(index)


class HpcdlSamples:
    """Map-style data set: item (epoch, index) = (images (C, H, W) float32 tensor, label)."""

    def __init__(self, data: str, augment: str = "none", seed: int = 0) -> None:
        self.ds = open_dataset(data)
        self.aug = parse_augment(augment)
        self.seed = seed
        self.shape = output_shape(self.ds, self.aug)
        self._builder: BatchBuilder | None = None
        self._pid = -1  # the process the builder's file handles belong to

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, item: tuple[int, int]) -> tuple[Any, int]:
        import torch  # noqa: PLC0415

        if self._pid != os.getpid():  # a DataLoader worker: open its own file handles
            self._builder = BatchBuilder(self.ds, self.aug, self.seed)
            self._pid = os.getpid()
        epoch, index = item
        images = np.empty((1, *self.shape), np.float32)
        labels = np.empty(1, np.int64)
        self._builder.build(np.array([index]), epoch, True, images, labels)
        return torch.from_numpy(images[0]), int(labels[0])
