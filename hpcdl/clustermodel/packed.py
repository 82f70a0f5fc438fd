"""The packed layout of the cluster model: a data set stored as S shards (docs/cluster-model.md,
section 6).

D samples of B bytes in all, in S shards of B / S bytes and m = D / S samples each (WebDataset
tar shards, HDF5 shards). The stager copies whole shards, one open each, ahead of need in the
order the plan first touches them; the PFS then sees opens per shard and bytes at its
bandwidth, through the same staging formula as the folder (equations.staging_rate), applied
to shards of B / S bytes.

Which shards a node must copy:
- without the peer tier (and with `--shuffle node` or `none`), every shard it touches, whole.
  With a global shuffle a node's F samples of an epoch are spread over the data set, and it
  touches S (1 - (1 - F / D)^m) shards: at 128 nodes x 1,024 shards, all of them, so every node
  copies the whole data set;
- with the peer tier (a global shuffle on 2+ nodes), each shard is copied from the PFS once in
  the job, by its home (the first node whose plan touches it: S / N shards a node), and every
  other node fetches from the home the byte ranges of its own samples only (the tier serves
  ranges). A node's first steps touch nearly every shard, so its first batch waits for the
  homes: a sample is ready after the homes' S / N shards, plus the node's fetches up to it.

Reads are the shuffle's expected values (equations.analytic_reads, over samples), whatever the
data set: the exact plans are the folder's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from hpcdl.clustermodel import equations, peers
from hpcdl.clustermodel.calibration import Calibration
from hpcdl.clustermodel.equations import JobShape, NodeReads, Prediction, StagingRate


@dataclass(frozen=True)
class PackedLayout:
    """A data set of `samples` samples and `nbytes` bytes stored as `shards` files."""

    shards: int
    samples: int
    nbytes: int

    @property
    def shard_bytes(self) -> float:
        return self.nbytes / self.shards

    @property
    def per_shard(self) -> float:  # m
        return self.samples / self.shards

    @property
    def sample_bytes(self) -> float:
        return self.nbytes / self.samples

    @property
    def name(self) -> str:
        return f"shards:{self.shards}"


def packed_layout(shards: int, samples: int, nbytes: int) -> PackedLayout:
    """The layout, or one line naming the flag and what to give (shards: 1 to the samples)."""
    if not 1 <= shards <= samples:
        raise ValueError(
            f"--shards {shards}: give the number of shard files, from 1 to the data set's "
            f"{samples} samples"
        )
    return PackedLayout(int(shards), int(samples), int(nbytes))


def shards_touched(layout: PackedLayout, shape: JobShape, read: np.ndarray) -> np.ndarray:
    """Expected shards holding `read` samples of a node, drawn at random from its span: the
    data set with a global shuffle, else its node's block of D / N samples (contiguous: the
    block's shards, one more where it straddles a boundary). A shard of the span holds m
    samples and is missed with probability (1 - read / span)^m."""
    span = layout.samples if shape.shuffle == "global" else layout.samples / shape.nodes
    shards = min(layout.shards, math.ceil(span / layout.per_shard) + (span < layout.samples))
    taken = np.minimum(np.asarray(read, dtype=np.float64), span) / span
    return shards * (1.0 - (1.0 - taken) ** layout.per_shard)


def samples_per_epoch(samples: NodeReads) -> int:
    """F: the samples a node reads in an epoch (0 where the data set is under one batch of
    every rank, and no step runs)."""
    return int(samples.first_needed[-1]) if len(samples.first_needed) else 0


def node_splits(
    layout: PackedLayout, shape: JobShape, samples: NodeReads, peer_tier: bool
) -> list[peers.PeerSplit]:
    """Every node's copies per epoch, busiest first: shards from the PFS (files: whole shards)
    and, with the peer tier, its samples' byte ranges fetched from the shards' homes."""
    read = samples_per_epoch(samples)  # F
    m, epochs, nodes = layout.per_shard, shape.epochs, shape.nodes
    if peer_tier:
        # a shard no node touched in e epochs is new, to one home: S q^(m e) (1 - q^m) in all
        unread = 1.0 - read * nodes / layout.samples  # q
        homes = [round(layout.shards * unread ** (m * e) * (1 - unread**m))
                 for e in range(epochs)]  # fmt: skip
        per_node = [[n // nodes + (i < n % nodes) for n in homes] for i in range(nodes)]
        fetched = [samples.new_files[0] * (1 - 1 / nodes), *samples.new_files[1:]]
        ranges = [round(n) for n in fetched]
    else:
        # whole shards: those first touched in epoch e (global: the union over the epochs)
        seen = [float(shards_touched(layout, shape, read)), *[0.0] * (epochs - 1)]
        if shape.shuffle == "global":
            kept = 1.0 - read / layout.samples
            seen = [layout.shards * (1 - kept ** (m * (e + 1))) for e in range(epochs)]
        total = [math.ceil(s) for s in np.maximum.accumulate(seen)]
        per_node = [[total[0]] + [b - a for a, b in zip(total, total[1:])]] * nodes
        ranges = [0] * epochs
    return [
        peers.PeerSplit(
            tuple(shards),
            tuple(int(n * layout.shard_bytes) for n in shards),
            tuple(ranges),
            tuple(int(n * layout.sample_bytes) for n in ranges),
        )
        for shards in per_node
    ]


def shards_staged_at(rate: StagingRate, count: np.ndarray | int) -> np.ndarray:
    """Seconds after staging starts at which the first `count` shards are on the node:
    max(p, count / r). A shard is one long sequential read, so the copy threads stream
    min(T, count) of them at once, sharing the limit that sets r, and they land together;
    the folder's p + (count - 1) / r (equations.staged_at) would add one thread's whole shard
    to the rest, which for files of 100 MB is not small."""
    n = np.asarray(count, dtype=np.float64)
    return np.where(n > 0, np.maximum(rate.per_file_s, n / rate.files_per_s), 0.0)


def ready_at(
    cal: Calibration,
    shape: JobShape,
    layout: PackedLayout,
    samples: NodeReads,
    rate: StagingRate,
    peer_tier: bool,
    home_shards: int = 0,
) -> np.ndarray:
    """Per step of epoch 1, when the samples of steps <= s are on the node (a trailing entry:
    the whole epoch's). Without the peer tier: the shards they touch, copied whole at the
    shard rate in first-touch order. With it: the node's home_shards (S / N) and every other
    home's, then the node's fetches of its samples' ranges up to there."""
    need = np.append(samples.first_needed, samples_per_epoch(samples))
    if not peer_tier:
        return shards_staged_at(rate, np.ceil(shards_touched(layout, shape, need)))
    homes = float(shards_staged_at(rate, home_shards))
    fetched = need * (1 - 1 / shape.nodes)
    fetch = [peers.peer_fetch_s(cal, shape.stage_threads, round(n), layout.sample_bytes)
             for n in fetched.tolist()]  # fmt: skip
    return homes + np.asarray(fetch)


def predict_packed(
    cal: Calibration, shape: JobShape, layout: PackedLayout, peer_tier: bool
) -> Prediction:
    """Every figure of the model for one job shape on the packed layout: equations.
    predict_shape's, with the copies above (section 6) in place of one file per sample."""
    samples = equations.analytic_reads(layout.samples, layout.nbytes, shape, shape.shuffle)
    every_node = node_splits(layout, shape, samples, peer_tier)
    split = every_node[0]
    # the busiest node as the PFS sees it: shards per epoch; its steps count samples
    reads = NodeReads(split.pfs_files, split.pfs_bytes, samples.first_needed,
                      samples.steps_per_epoch, "analytic")  # fmt: skip
    rate = equations.staging_rate_for(cal, shape, layout.shard_bytes)
    step = equations.step_time(cal, shape)
    ready = ready_at(cal, shape, layout, samples, rate, peer_tier, split.pfs_files[0])
    one = equations.step_clock(ready[:-1], samples, step.step_s, shape.lead_s, float(ready[-1]))
    compute_epoch = samples.steps_per_epoch * step.step_s
    epoch1_s = max(one.seconds, compute_epoch + equations.contention_s(cal, split)[0])
    later = equations.later_epochs(cal, shape, rate, split, compute_epoch, split.pfs_files[0])
    later = later or [compute_epoch]
    saving = equations.checkpoints_per_epoch(shape, samples.steps_per_epoch)
    saving_s = saving * cal.compute.checkpoint_s
    timing = (one, epoch1_s + saving_s, [e + saving_s for e in later])
    return equations.assemble(cal, shape, reads, None, every_node, rate, step, timing, peer_tier,
                              layout.name)  # fmt: skip
