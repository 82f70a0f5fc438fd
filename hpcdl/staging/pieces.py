"""Pieces: the byte ranges of tar shards a node fetches from their home, instead of whole shards.

With `--shuffle global` on N nodes a node reads about 1/N of every shard an epoch; fetching each
shard whole from its home would copy nearly the data set to every node (docs/cluster-model.md,
section 6). A *piece* is one sample's image bytes, [data_at, data_at + data_len) of its shard.
A node whose plan reads few samples of a shard homed on another node gets one plan entry per
piece instead of one for the shard: the stager fetches each range from the home (or, failing
that, copies the range from the PFS shard) and publishes it as its own small file, and the
reader takes a sample from its piece when the piece is READY (docs/staging.md, "Pieces").

Status-map slots: shards first (slot = file id), then one per sample (slot = shards + sample
index). Every plan of a run in which pieces may appear has that many slots, so a replan never
resizes the map. `--peer-ranges`: `auto` splits a shard when its pieces cost less to fetch than
the shard: a fetch costs a peer's latency on top of its bytes, so the node's pieces of the shard
in the plan's window are charged their bytes plus FETCH_BYTES each, against the shard's bytes
(ImageNet's 137 MB shards at 128 nodes: 20 pieces of 110 KB, 4 MB against 137 MB; 960 PNGs of
3 KB in 8 shards on 8 emulated nodes: 28 pieces, 2.9 MB against 0.6 MB, whole shards, which
measured faster there: docs/PERFORMANCE.md, "Issue 62: pieces"); `on` splits every shard
homed elsewhere (tests); `off` keeps whole shards.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import numpy as np

from hpcdl.staging.peers import NO_HOME, FileHomes
from hpcdl.staging.plan import NodePlan, TickLists

RANGE_MODES = ("auto", "on", "off")
# What one fetch's latency costs, in bytes at a fetching thread's bandwidth: the cluster model's
# peer figures without a calibration (clustermodel.calibration.DEFAULT_PEER: 1 ms at 100 MB/s).
FETCH_BYTES = 100_000
PIECES_DIR = ".pieces"  # a piece's dest: "<shard dest>.pieces/<offset>"


def pieces_possible(dataset: Any, mode: str) -> bool:
    """Whether a run over `dataset` may fetch pieces (tar shards, --peer-ranges not off)."""
    if mode not in RANGE_MODES:
        raise ValueError(f"--peer-ranges must be one of {', '.join(RANGE_MODES)}, got {mode!r}")
    return mode != "off" and getattr(dataset, "kind", "") == "tar"


def piece_relpath(shard_relpath: str, offset: int) -> str:
    """Where the piece of a shard at `offset` lands, relative to the data set's staged tree."""
    return f"{shard_relpath}{PIECES_DIR}/{int(offset)}"


class _SlotSizes:
    """The `files` a planner sees over slots: sizes only (plan_for_node reads no names)."""

    def __init__(self, sizes: np.ndarray) -> None:
        self.sizes = sizes

    def __len__(self) -> int:
        return len(self.sizes)


@dataclass(frozen=True)
class PieceSlots:
    """The slots of a tar shard data set: its shards, then one piece per sample."""

    dataset: Any  # a TarShardDataset

    @property
    def shards(self) -> int:
        return len(self.dataset.files)

    @property
    def slots(self) -> int:
        return self.shards + len(self.dataset)

    @property
    def root(self) -> Any:
        return self.dataset.root

    @cached_property
    def files(self) -> _SlotSizes:
        cols = self.dataset.index.columns
        shard_sizes = np.asarray(self.dataset.files.sizes, np.int64)
        return _SlotSizes(np.concatenate([shard_sizes, np.asarray(cols["data_len"], np.int64)]))

    def file_ids(self, indices: np.ndarray) -> np.ndarray:
        """The piece slot of each sample index (the planner's view: every sample a piece)."""
        return np.asarray(indices, dtype=np.int64) + self.shards

    def shard_of(self, slots: np.ndarray) -> np.ndarray:
        """The shard of each slot: itself for a shard, the sample's shard for a piece."""
        slots = np.asarray(slots, np.int64)
        piece = slots >= self.shards
        shard = slots.copy()
        if piece.any():
            shard[piece] = self.dataset.file_ids(slots[piece] - self.shards)
        return shard

    def offsets(self, slots: np.ndarray) -> np.ndarray:
        """The byte offset in its shard of each piece slot."""
        at = self.dataset.index.columns["data_at"]
        return np.asarray(at, np.int64)[np.asarray(slots, np.int64) - self.shards]

    def names(self, slots: np.ndarray) -> tuple[list[str], list[str]]:
        """(dest relpaths, source relpaths) of slots: a piece lands beside its shard's name
        (piece_relpath) and is read from the shard."""
        slots = np.asarray(slots, np.int64)
        shard = self.shard_of(slots)
        sources = self.dataset.files.relpaths(shard)
        dests = list(sources)
        piece = np.flatnonzero(slots >= self.shards)
        for k, at in zip(piece.tolist(), self.offsets(slots[piece]).tolist()):
            dests[k] = piece_relpath(sources[k], at)
        return dests, sources

    def section(self, plan: NodePlan) -> list[str]:
        """The plan file's `pieces` lines: per piece entry, its slot, shard, the shard's size
        and the piece's offset in it (docs/staging.md, "plan")."""
        slots = plan.file_ids[plan.file_ids >= self.shards]
        shard = self.shard_of(slots)
        sizes = np.asarray(self.dataset.files.sizes, np.int64)[shard]
        at = self.offsets(slots)
        lines = [f"pieces {len(slots)}"]
        lines.extend(
            f"{s}\t{f}\t{n}\t{a}"
            for s, f, n, a in zip(slots.tolist(), shard.tolist(), sizes.tolist(), at.tolist())
        )
        return lines

    def homes(self, homes: FileHomes) -> FileHomes:
        """`homes` over slots: a piece's home is its shard's, from the shard's first read."""
        shard = self.dataset.file_ids(np.arange(len(self.dataset), dtype=np.int64))
        return FileHomes(
            node=np.concatenate([homes.node, homes.node[shard]]),
            tick=np.concatenate([homes.tick, homes.tick[shard]]),
            steps_per_epoch=homes.steps_per_epoch,
        )


def split_shards(
    shard_plan: NodePlan,
    piece_plan: NodePlan,
    slots: PieceSlots,
    homes: FileHomes,
    up: Sequence[bool],
    mode: str,
) -> NodePlan:
    """shard_plan with the shards this node should fetch as pieces replaced by the entries of
    piece_plan (the same node and epochs, every sample a piece) of those shards.

    A shard is split when its home is another node that serves (up), and `mode` is `on`, or
    `auto` and the node's pieces of it cost less than the shard: their bytes plus FETCH_BYTES
    each, under the shard's size."""
    if mode == "off" or shard_plan.files == 0:
        return shard_plan
    ids = shard_plan.file_ids
    home = homes.node[ids]
    serving = np.asarray(list(up) + [False], dtype=bool)  # index -1 (NO_HOME) -> False
    split = (home != NO_HOME) & (home != shard_plan.node) & serving[home]
    piece_shard = slots.shard_of(piece_plan.file_ids)
    if mode == "auto":
        cost = piece_plan.sizes.astype(np.float64) + FETCH_BYTES
        piece_cost = np.bincount(piece_shard, weights=cost, minlength=slots.shards)
        split &= piece_cost[ids] < shard_plan.sizes
    chosen = np.zeros(slots.shards, dtype=bool)
    chosen[ids[split]] = True
    kept_shards = np.flatnonzero(~split)
    kept_pieces = np.flatnonzero(chosen[piece_shard])
    return _merged(shard_plan, kept_shards, piece_plan, kept_pieces)


def _merged(a: NodePlan, take_a: np.ndarray, b: NodePlan, take_b: np.ndarray) -> NodePlan:
    """The entries take_a of plan a and take_b of plan b, in first-use order (a first on ties)."""
    first = np.concatenate([a.first_use()[take_a], b.first_use()[take_b]])
    order = np.argsort(first, kind="stable")
    values_a, bounds_a = a.tick_table()
    values_b, bounds_b = b.tick_table()
    every = np.concatenate([values_a, values_b]).astype(np.int64)
    starts = np.concatenate([bounds_a[take_a], len(values_a) + bounds_b[take_b]])[order]
    counts = np.concatenate([np.diff(bounds_a)[take_a], np.diff(bounds_b)[take_b]])[order]
    bounds = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    values = every[np.repeat(starts - bounds[:-1], counts) + np.arange(bounds[-1])]
    file_ids = np.concatenate([a.file_ids[take_a], b.file_ids[take_b]])[order]
    sizes = np.concatenate([a.sizes[take_a], b.sizes[take_b]])[order]
    return replace(a, file_ids=file_ids, ticks=TickLists(values, bounds), sizes=sizes)
