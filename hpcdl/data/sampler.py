"""Distributed sampler: which sample indices a rank reads, as a pure function of its arguments.

Everything a rank will read is fixed by (num_samples, seed, epoch, world size, rank, shuffle
mode and, for shuffle='node', which world ranks share a node). The staging planner relies on
this to copy files ahead of need.

Placement is a fact, not arithmetic: `ranks_by_node` lists the world ranks on each node as the
node communicator found them (hpcdl.comm.world.World.ranks_by_node). Launchers number ranks
node by node (mpirun's default, Slurm's block distribution), round robin (`mpirun --map-by
node`, Slurm's cyclic distribution) or unevenly, so `node * ranks_per_node + local_rank` is
wrong in general. `rank_layout` gives the layout of a known placement where no MPI job exists
to ask (dry runs, stage-only jobs that plan for a later training job).

Remainder policy: every rank gets exactly ``num_samples // world_size`` samples per epoch. The
``num_samples % world_size`` samples left over are dropped for that epoch only; with shuffling
a different set is dropped each epoch, so every sample is seen equally often over a run. No
sample appears twice in one epoch. Within a rank, the last partial batch is dropped too (so
every rank runs the same number of steps and no step sees a tiny batch).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

SHUFFLE_MODES = ("global", "node", "none")
PLACEMENTS = ("block", "cyclic")
_NODE_SPLIT_STREAM = 2**31  # RNG stream of the fixed sample-to-node split (shuffle='node')

NodeLayout = tuple[tuple[int, ...], ...]  # world ranks on each node, by node index


def rank_layout(ranks_per_node: Sequence[int], placement: str = "block") -> NodeLayout:
    """World ranks on each node when a launcher places ranks by `placement`.

    ranks_per_node: one count per node. 'block' fills node 0 first, then node 1 (mpirun's
    default, Slurm --distribution=block); 'cyclic' deals ranks out one per node in turn,
    skipping full nodes (mpirun --map-by node, Slurm --distribution=cyclic)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    counts = [int(c) for c in ranks_per_node]
    if not counts or min(counts) < 1:
        raise ValueError(f"ranks per node must be at least 1 on every node, got {counts}")
    if placement == "block":
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        return tuple(tuple(range(int(a), int(a) + c)) for a, c in zip(starts, counts))
    nodes: list[list[int]] = [[] for _ in counts]
    rank = 0
    while rank < sum(counts):
        for node, count in enumerate(counts):
            if len(nodes[node]) < count:
                nodes[node].append(rank)
                rank += 1
    return tuple(tuple(ranks) for ranks in nodes)


def epoch_rng(seed: int, epoch: int, stream: int = 0) -> np.random.Generator:
    """The RNG for (seed, epoch, stream); independent of world size, rank and workers."""
    return np.random.default_rng(np.random.SeedSequence([seed, epoch, stream]))


@functools.lru_cache(maxsize=4)
def _places_every_rank_once(world_size: int, ranks_by_node: NodeLayout) -> bool:
    """The layout check of every sampler, once per layout: at 8,192 ranks it is 0.5 ms, and
    each epoch's plan builds a sampler per local rank."""
    return sorted(r for ranks in ranks_by_node for r in ranks) == list(range(world_size))


@functools.lru_cache(maxsize=4)
def _layout_index(world_size: int, layout: NodeLayout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(node of each rank, its local rank, ranks per node), read-only, once per layout: a loop
    over the nodes that every epoch's plan needs (5 ms at 1,024 nodes)."""
    node_of = np.empty(world_size, np.int64)
    local_of = np.empty(world_size, np.int64)
    for node, ranks in enumerate(layout):
        node_of[list(ranks)] = node
        local_of[list(ranks)] = np.arange(len(ranks))
    sizes = np.array([len(ranks) for ranks in layout], np.int64)
    for array in (node_of, local_of, sizes):
        array.flags.writeable = False
    return node_of, local_of, sizes


@functools.lru_cache(maxsize=2)
def epoch_permutation(seed: int, epoch: int, num_samples: int) -> np.ndarray:
    """shuffle='global': the epoch's permutation of all samples (read-only). Kept for the two
    newest epochs: local rank 0 plans epoch e + 1 for the stager while its ranks read epoch e,
    and its own sampler then finds it drawn (ImageNet's 1.28M samples: tens of ms each, holding
    the GIL, on the path every rank waits for at the next allreduce)."""
    perm = epoch_rng(seed, epoch).permutation(num_samples)
    perm.flags.writeable = False
    return perm


@functools.lru_cache(maxsize=1)
def node_split(seed: int, num_samples: int) -> np.ndarray:
    """shuffle='node': the fixed permutation that splits the samples into node blocks
    (read-only); the same every epoch, so drawn once per process."""
    perm = epoch_rng(seed, 0, stream=_NODE_SPLIT_STREAM).permutation(num_samples)
    perm.flags.writeable = False
    return perm


@dataclass(frozen=True)
class DistributedSampler:
    """Per-rank shard of each epoch.

    shuffle='global': one permutation of all samples per epoch, cut into equal rank shards.
    shuffle='node': samples are split once (by seed, not epoch) into one block per node, sized
        by the node's number of ranks; each epoch permutes a node's block among that node's
        ranks only, so a node keeps reading the same files every epoch (staging copies them
        once). Which ranks share a node comes from ranks_by_node; without it every rank is a
        node of its own.
    shuffle='none': rank r reads the contiguous block r, the same every epoch.

    ranks_by_node: world ranks on each node, in node order and each node's local-rank order;
    every rank exactly once. Only shuffle='node' reads it; the same samples reach a node's ranks
    whatever numbers the launcher gave them.
    """

    num_samples: int
    world_size: int = 1
    rank: int = 0
    seed: int = 0
    shuffle: str = "global"
    ranks_by_node: NodeLayout = ()

    def __post_init__(self) -> None:
        if self.shuffle not in SHUFFLE_MODES:
            raise ValueError(f"shuffle must be one of {SHUFFLE_MODES}, got {self.shuffle!r}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world of size {self.world_size}")
        if self.num_samples < self.world_size:
            raise ValueError(
                f"{self.num_samples} samples cannot be shared by {self.world_size} ranks"
            )
        layout = tuple(map(tuple, self.ranks_by_node))  # hashable, whatever the caller gave
        if layout and not _places_every_rank_once(self.world_size, layout):
            raise ValueError(
                f"ranks_by_node must hold every rank of 0..{self.world_size - 1} exactly once, "
                f"got {self.ranks_by_node}"
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
            perm = epoch_permutation(self.seed, epoch, n)
            return perm[self.rank * per : (self.rank + 1) * per].astype(np.int64)
        layout = self.ranks_by_node or tuple((r,) for r in range(self.world_size))
        node_of, local_of, sizes = _layout_index(self.world_size, tuple(map(tuple, layout)))
        node, local = int(node_of[self.rank]), int(local_of[self.rank])
        first = per * int(sizes[:node].sum())  # node blocks in node order
        fixed = node_split(self.seed, n)
        block = fixed[first : first + per * int(sizes[node])]
        mixed = epoch_rng(self.seed, epoch, stream=node + 1).permutation(block)
        return mixed[local * per : (local + 1) * per].astype(np.int64)

    def batches(self, epoch: int, batch_size: int) -> list[np.ndarray]:
        """This rank's minibatches for one epoch (last partial batch dropped)."""
        idx = self.indices(epoch)
        steps = len(idx) // batch_size
        return [idx[s * batch_size : (s + 1) * batch_size] for s in range(steps)]


@dataclass(frozen=True)
class SamplerSpec:
    """Everything that fixes every rank's reading order: DistributedSampler's fields but the rank.

    Built once per job (trainer, stage-only job, dry run); the staging planner takes the views
    of a node's ranks (for_ranks), the trainer its own rank's (for_rank)."""

    num_samples: int
    world_size: int = 1
    seed: int = 0
    shuffle: str = "global"
    ranks_by_node: NodeLayout = ()

    def for_rank(self, rank: int) -> DistributedSampler:
        """The sampler of one world rank."""
        return DistributedSampler(
            self.num_samples,
            self.world_size,
            int(rank),
            self.seed,
            self.shuffle,
            self.ranks_by_node,
        )

    def for_ranks(self, ranks: Sequence[int]) -> list[DistributedSampler]:
        """The samplers of the given world ranks (a node's, in local-rank order)."""
        return [self.for_rank(rank) for rank in ranks]

    def rank_indices(self, epoch: int, ranks: Sequence[int] | None = None) -> np.ndarray:
        """(len(ranks), samples_per_rank) int64: row i is for_rank(ranks[i]).indices(epoch).

        Draws the epoch's permutation once for all the ranks ('global'), or once per node
        they sit on ('node'), where DistributedSampler draws it once per rank: the planners
        of a node and of a whole job (dry runs) use this. ranks: world ranks (default all,
        in rank order)."""
        sampler = self.for_rank(0)  # checks the spec
        want = np.arange(self.world_size) if ranks is None else np.asarray(ranks, np.int64)
        if want.size and (want.min() < 0 or want.max() >= self.world_size):
            raise ValueError(f"ranks {want.tolist()} outside world of size {self.world_size}")
        per = sampler.samples_per_rank
        if self.shuffle == "none":
            return want[:, None] * per + np.arange(per, dtype=np.int64)
        if self.shuffle == "global":
            perm = epoch_permutation(self.seed, epoch, self.num_samples)
            return perm[: self.world_size * per].reshape(self.world_size, per)[want]
        return self._node_rank_indices(epoch, want, per)

    def _node_rank_indices(self, epoch: int, want: np.ndarray, per: int) -> np.ndarray:
        """rank_indices for shuffle='node': each node's block, permuted once per epoch."""
        layout = self.ranks_by_node or tuple((r,) for r in range(self.world_size))
        node_of, local_of, sizes = _layout_index(self.world_size, tuple(map(tuple, layout)))
        firsts = per * np.concatenate([[0], np.cumsum(sizes)[:-1]])  # node blocks in node order
        fixed = node_split(self.seed, self.num_samples)
        out = np.empty((len(want), per), np.int64)
        for node in np.unique(node_of[want]).tolist():
            block = fixed[firsts[node] : firsts[node] + per * sizes[node]]
            mixed = epoch_rng(self.seed, epoch, stream=node + 1).permutation(block)
            rows = np.flatnonzero(node_of[want] == node)
            out[rows] = mixed.reshape(sizes[node], per)[local_of[want[rows]]]
        return out


def eval_indices(num_samples: int, world_size: int, rank: int) -> np.ndarray:
    """Validation shard: every sample exactly once across ranks (shards may differ by one)."""
    return np.arange(rank, num_samples, world_size, dtype=np.int64)
