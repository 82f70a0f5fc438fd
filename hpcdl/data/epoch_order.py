"""Finishing an interrupted epoch with another world size: every remaining sample exactly once.

NOTE [the rest of an epoch]
A job reads an epoch in global steps: at step t, rank r trains on batch t of its sampler shard
(hpcdl.data.sampler), so the epoch's global order is step 0's batches of ranks 0..W-1, then
step 1's, and so on; global batch t is that order's slice [t*G, (t+1)*G), G = W * B. A
checkpoint taken after `samples_done` samples of that order (step_in_epoch * G) records the
order it was reading (EpochOrder: world size, per-rank batch, which ranks share a node), so a
job that resumes it with W' ranks can rebuild exactly the samples the checkpointed state has
not seen: the global order from samples_done on (MLPerf's rule: every sample of an epoch once).

The rest is cut into global batches of G' = W' * B' in that order, rank r' taking slice
[r'*B', (r'+1)*B') of each: with B' = G / W' (the global batch kept, resume_batch) every global
batch of the rest holds exactly the samples the interrupted job would have put in it, and no
sample is dropped. When W' does not divide G, B' = G // W' (G' < G) and the last
len(rest) % G' samples, fewer than one global batch, are dropped, as the sampler drops a
partial batch; the start-up line says how many. Checkpoints taken inside the rest keep the
interrupted order and count samples_done on in it, so a resume with yet another world size
still finishes the same epoch. Later epochs use the new world size's sampler.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hpcdl.data.sampler import NodeLayout, SamplerSpec


@dataclass(frozen=True)
class EpochOrder:
    """How the epoch a checkpoint stopped in was being read, and how far (NOTE above)."""

    world_size: int
    batch_size: int  # per rank
    ranks_by_node: NodeLayout = ()  # only shuffle='node' reads it
    samples_done: int = 0  # of the epoch's global order

    @property
    def global_batch(self) -> int:
        return self.world_size * self.batch_size

    def to_json(self) -> dict:
        return {
            "world_size": self.world_size,
            "batch_size": self.batch_size,
            "ranks_by_node": [list(ranks) for ranks in self.ranks_by_node],
            "samples_done": self.samples_done,
        }

    @classmethod
    def from_json(cls, value: dict) -> EpochOrder:
        """ValueError (or KeyError, TypeError) when value is not what to_json wrote."""
        order = cls(
            world_size=int(value["world_size"]),
            batch_size=int(value["batch_size"]),
            ranks_by_node=tuple(tuple(int(r) for r in ranks) for ranks in value["ranks_by_node"]),
            samples_done=int(value["samples_done"]),
        )
        if min(order.world_size, order.batch_size) < 1 or order.samples_done < 0:
            raise ValueError(f"impossible epoch order {value!r}")
        return order


def global_order(spec: SamplerSpec, epoch: int, batch_size: int) -> np.ndarray:
    """The epoch's samples in global-step order: int64 (steps * world_size * batch_size,)."""
    shards = [
        np.stack(spec.for_rank(rank).batches(epoch, batch_size)) for rank in range(spec.world_size)
    ]  # each (steps, B)
    return np.stack(shards, axis=1).reshape(-1)  # (steps, W, B) read step by step


def rest_of_epoch(
    spec: SamplerSpec, order: EpochOrder, epoch: int, rank: int, world_size: int, batch_size: int
) -> list[np.ndarray]:
    """Batches of `rank` (of world_size, batch_size each) that finish `epoch` as `order` was
    reading it: spec is the job's spec but the world size and placement come from order."""
    interrupted = SamplerSpec(
        spec.num_samples, order.world_size, spec.seed, spec.shuffle, order.ranks_by_node
    )
    rest = global_order(interrupted, epoch, order.batch_size)[order.samples_done :]
    step = world_size * batch_size
    first = rank * batch_size
    return [rest[s + first : s + first + batch_size] for s in range(0, len(rest) - step + 1, step)]


def rest_size(num_samples: int, order: EpochOrder) -> int:
    """Samples of the interrupted epoch that order had not read yet."""
    steps = (num_samples // order.world_size) // order.batch_size
    return max(0, steps * order.global_batch - order.samples_done)


def resume_batch(global_batch: int, world_size: int) -> int:
    """Per-rank batch that keeps a checkpoint's global batch on world_size ranks, or the
    largest below it when world_size does not divide it (NOTE above); at least 1."""
    return max(1, global_batch // world_size)
