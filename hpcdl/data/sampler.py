"""Distributed sampler: which sample indices a rank reads, as a pure function of its arguments.

Everything a rank will read is fixed by (num_samples, seed, epoch, world size, rank, shuffle
mode, ranks per node). The staging planner relies on this to copy files ahead of need.

Remainder policy: every rank gets exactly ``num_samples // world_size`` samples per epoch. The
``num_samples % world_size`` samples left over are dropped for that epoch only; with shuffling
a different set is dropped each epoch, so every sample is seen equally often over a run. No
sample appears twice in one epoch. Within a rank, the last partial batch is dropped too (so
every rank runs the same number of steps and no step sees a tiny batch).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SHUFFLE_MODES = ("global", "node", "none")
_NODE_SPLIT_STREAM = 2**31  # RNG stream of the fixed sample-to-node split (shuffle='node')


def epoch_rng(seed: int, epoch: int, stream: int = 0) -> np.random.Generator:
    """The RNG for (seed, epoch, stream); independent of world size, rank and workers."""
    return np.random.default_rng(np.random.SeedSequence([seed, epoch, stream]))


@dataclass(frozen=True)
class DistributedSampler:
    """Per-rank shard of each epoch.

    shuffle='global': one permutation of all samples per epoch, cut into equal rank shards.
    shuffle='node': samples are split once (by seed, not epoch) into one block per node; each
        epoch permutes a node's block among that node's ranks only, so a node keeps reading the
        same files every epoch (staging copies them once). Assumes ranks are numbered node by
        node: rank = node * ranks_per_node + local_rank (Open MPI's and Slurm's default block
        mapping).
    shuffle='none': rank r reads the contiguous block r, the same every epoch.
    """

    num_samples: int
    world_size: int = 1
    rank: int = 0
    seed: int = 0
    shuffle: str = "global"
    ranks_per_node: int = 1

    def __post_init__(self) -> None:
        if self.shuffle not in SHUFFLE_MODES:
            raise ValueError(f"shuffle must be one of {SHUFFLE_MODES}, got {self.shuffle!r}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world of size {self.world_size}")
        if self.num_samples < self.world_size:
            raise ValueError(
                f"{self.num_samples} samples cannot be shared by {self.world_size} ranks"
            )
        if self.shuffle == "node" and self.world_size % self.ranks_per_node:
            raise ValueError(
                f"shuffle='node' needs world size ({self.world_size}) divisible by ranks per "
                f"node ({self.ranks_per_node})"
            )

    @property
    def samples_per_rank(self) -> int:
        return self.num_samples // self.world_size

    def steps_per_epoch(self, batch_size: int) -> int:
        return self.samples_per_rank // batch_size

    def indices(self, epoch: int) -> np.ndarray:
        """This rank's sample indices for one epoch, in reading order: int64 (samples_per_rank,)."""
        n, per = self.num_samples, self.samples_per_rank
        if self.shuffle == "none":
            return np.arange(self.rank * per, (self.rank + 1) * per, dtype=np.int64)
        if self.shuffle == "global":
            perm = epoch_rng(self.seed, epoch).permutation(n)
            return perm[self.rank * per : (self.rank + 1) * per].astype(np.int64)
        nodes = self.world_size // self.ranks_per_node
        node, local = divmod(self.rank, self.ranks_per_node)
        fixed = epoch_rng(self.seed, 0, stream=_NODE_SPLIT_STREAM).permutation(n)
        per_node = per * self.ranks_per_node
        block = fixed[node * per_node : (node + 1) * per_node]
        assert nodes * per_node <= n
        mixed = epoch_rng(self.seed, epoch, stream=node + 1).permutation(block)
        return mixed[local * per : (local + 1) * per].astype(np.int64)

    def batches(self, epoch: int, batch_size: int) -> list[np.ndarray]:
        """This rank's minibatches for one epoch (last partial batch dropped)."""
        idx = self.indices(epoch)
        steps = len(idx) // batch_size
        return [idx[s * batch_size : (s + 1) * batch_size] for s in range(steps)]


def eval_indices(num_samples: int, world_size: int, rank: int) -> np.ndarray:
    """Validation shard: every sample exactly once across ranks (shards may differ by one)."""
    return np.arange(rank, num_samples, world_size, dtype=np.int64)
