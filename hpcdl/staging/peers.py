"""Which peer holds a verified copy of each file, and from when: the plan side of the peer tier.

A file's home is the node that reads it first in the run, among the nodes whose whole run fits
their stage capacity (a node that must evict may drop a copy before a peer asks for it). The
home stages the file from the PFS; every other node that reads it later fetches it from the
home, once the home's ranks have read it (its stager copied it by then). The order is a pure
function of the seed, so every node leader computes the same homes from the same inputs: the
sampler, the node layout and every node's capacity (gathered at start). docs/staging.md, "Peer
tier", has the whole design; this module only answers "who, and from which step".

Ticks are absolute here: epoch * steps_per_epoch + step. A plan's ticks count from its first
epoch, so peer_sources converts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hpcdl.data.sampler import SamplerSpec
from hpcdl.staging.plan import NodePlan, epoch_range

NO_HOME = -1


@dataclass(frozen=True)
class FileHomes:
    """Per data set file: its home node (NO_HOME: read from the PFS by all) and the absolute
    tick at which the home first reads it."""

    node: np.ndarray  # (files,) int32, NO_HOME where no fitting node reads the file
    tick: np.ndarray  # (files,) int64 absolute first-read tick of the home (-1 with NO_HOME)
    steps_per_epoch: int


@dataclass(frozen=True)
class PeerSources:
    """Per entry of one NodePlan: the node to fetch from (NO_HOME: the PFS) and the plan tick
    from which the fetch may start."""

    peer: np.ndarray  # (F,) int32
    ready_tick: np.ndarray  # (F,) int64, in the plan's own ticks, >= 0

    @property
    def count(self) -> int:
        return int((self.peer != NO_HOME).sum())


def file_homes(
    dataset: Any,
    sampler: SamplerSpec,
    batch_size: int,
    epochs: tuple[int, int],
    layout: Sequence[Sequence[int]],
    fits: Sequence[bool],
) -> FileHomes:
    """The home of every data set file for a run of epochs [begin, end).

    layout: world ranks of each node (World.ranks_by_node). fits: per node, whether its whole
    run's files fit its stage capacity (only those may be homes). Ties within one step go to the
    first of the tied nodes at or after node (file id mod nodes), counting round: a shard's
    samples are read by many nodes in the first step, and the lowest index would make node 0
    the home of hundreds of shards (ImageNet's 1,024 at 128 nodes: 221 on node 0, 59 on node
    5), where each node should hold S / N (docs/cluster-model.md, section 6). Epochs are
    scanned from `begin` and the scan stops once every file has a home, so a global shuffle
    costs about one epoch's permutation."""
    begin, end = epoch_range(epochs)
    if len(fits) != len(layout):
        raise ValueError(f"{len(fits)} capacity answers for {len(layout)} nodes")
    steps = sampler.for_rank(0).steps_per_epoch(batch_size)
    nfiles, nnodes = len(dataset.files), len(layout)
    best = np.full(nfiles, np.iinfo(np.int64).max, dtype=np.int64)  # tick * nodes + node
    homed = [node for node in range(nnodes) if fits[node]]
    if homed and steps > 0:
        ranks = np.concatenate([np.asarray(layout[node], np.int64) for node in homed])
        node_of_row = np.repeat(np.asarray(homed, np.int64), [len(layout[n]) for n in homed])
        step_of_pos = np.arange(steps * batch_size, dtype=np.int64) // batch_size
        for epoch in range(begin, end):
            used = sampler.rank_indices(epoch, ranks)[:, : steps * batch_size]
            ids = np.asarray(dataset.file_ids(used.reshape(-1)), dtype=np.int64)
            ticks = epoch * steps + step_of_pos[None, :]
            turn = (node_of_row[:, None] - ids.reshape(used.shape)) % nnodes  # ties, round
            keys = (ticks * nnodes + turn).reshape(-1)
            np.minimum.at(best, ids, keys)
            if (best != np.iinfo(np.int64).max).all():
                break  # later epochs only have later ticks
    found = best != np.iinfo(np.int64).max
    turn = best % max(nnodes, 1)
    node = np.where(found, (turn + np.arange(nfiles)) % max(nnodes, 1), NO_HOME).astype(np.int32)
    tick = np.where(found, best // max(nnodes, 1), -1).astype(np.int64)
    return FileHomes(node=node, tick=tick, steps_per_epoch=steps)


def peer_sources(plan: NodePlan, homes: FileHomes, up: Sequence[bool] | None = None) -> PeerSources:
    """Where each entry of `plan` comes from: its home when the home is another node that is up
    and reads the file before this node first does in this plan; else the PFS.

    up: per node, whether it serves peers (None: all do); a node whose peer tier could not
    start is nobody's source."""
    if homes.steps_per_epoch != plan.steps_per_epoch:
        raise ValueError("homes and plan disagree on the steps per epoch")
    home = homes.node[plan.file_ids]
    home_tick = homes.tick[plan.file_ids]
    offset = plan.epoch_begin * plan.steps_per_epoch
    first_use = plan.first_use()
    usable = (home != NO_HOME) & (home != plan.node) & (home_tick < first_use + offset)
    if up is not None:
        serving = np.asarray(list(up) + [False], dtype=bool)  # index -1 (NO_HOME) -> False
        usable &= serving[home]
    peer = np.where(usable, home, NO_HOME).astype(np.int32)
    ready = np.where(usable, np.maximum(home_tick - offset, 0), 0).astype(np.int64)
    return PeerSources(peer=peer, ready_tick=ready)


def render_peer_section(
    plan: NodePlan, sources: PeerSources, addresses: Sequence[str | None]
) -> list[str]:
    """The plan file's optional peer lines (docs/staging.md, "plan"): the peers this node
    fetches from, with their addresses, then one line per entry fetched from a peer."""
    used = sorted({int(p) for p in sources.peer.tolist() if p != NO_HOME})
    for node in used:
        address = addresses[node]
        if not address or any(c in address for c in "\t\n "):
            raise ValueError(f"node {node} has no usable peer address ({address!r})")
    lines = [f"peers {len(used)}"] + [f"{node}\t{addresses[node]}" for node in used]
    fetched = np.flatnonzero(sources.peer != NO_HOME)
    lines.append(f"peer_sources {len(fetched)}")
    fids = plan.file_ids[fetched].tolist()
    peers = sources.peer[fetched].tolist()
    ready = sources.ready_tick[fetched].tolist()
    lines.extend(f"{f}\t{p}\t{t}" for f, p, t in zip(fids, peers, ready))
    return lines


@dataclass(frozen=True)
class EpochSources:
    """Per epoch of a run, summed over nodes: the copies the stagers make, and their source.

    Without peers every copy comes from the PFS (staged_*); with peers, pfs_* + peer_* make up
    the same copies. A node whose run fits its capacity copies each file once, at its first
    read; one that does not fit is counted as copying every epoch's files again (eviction)."""

    staged_files: np.ndarray  # (E,) int64
    staged_bytes: np.ndarray
    pfs_files: np.ndarray
    pfs_bytes: np.ndarray
    peer_files: np.ndarray
    peer_bytes: np.ndarray


def epoch_sources(
    dataset: Any,
    sampler: SamplerSpec,
    batch_size: int,
    epochs: tuple[int, int],
    layout: Sequence[Sequence[int]],
    fits: Sequence[bool],
) -> EpochSources:
    """What the stagers of every node copy per epoch of [begin, end), with and without the peer
    tier (the dry run's figures). One permutation per epoch; O(epochs x samples)."""
    begin, end = int(epochs[0]), int(epochs[1])
    homes = file_homes(dataset, sampler, batch_size, epochs, layout, fits)
    steps, nfiles = homes.steps_per_epoch, len(dataset.files)
    sizes = np.asarray(dataset.files.sizes, dtype=np.int64)
    per_rank = steps * batch_size
    figures = np.zeros((6, end - begin), dtype=np.int64)
    id_type = np.int32 if nfiles < 2**31 else np.int64
    by_epoch = [  # (world, per_rank) file ids of every rank, as node_figures keeps them
        np.asarray(
            dataset.file_ids(sampler.rank_indices(epoch)[:, :per_rank].reshape(-1)), id_type
        ).reshape(sampler.world_size, per_rank)
        for epoch in range(begin, end)
    ]
    step_of = np.arange(per_rank, dtype=np.int64) // max(batch_size, 1)
    nepochs = end - begin
    tick_span = end * steps + 1  # above every absolute tick of the run
    for node, ranks in enumerate(layout):
        rows = list(ranks)
        # (E * L * per_rank,) reads of the node, and their absolute ticks
        ids = np.concatenate([b[rows].reshape(-1) for b in by_epoch]).astype(np.int64)
        ticks = (np.arange(begin, end, dtype=np.int64)[:, None] * steps
                 + np.tile(step_of, len(rows))[None, :]).reshape(-1)  # fmt: skip
        # A node that fits copies a file once, at its first read; one that does not, again in
        # every epoch that reads it (eviction).
        key = ids if fits[node] else (ticks // max(steps, 1) - begin) * nfiles + ids
        # One sort of (key, tick) packed in an int64 (a lexsort costs 20x more here).
        packed = np.sort(key * tick_span + ticks)
        key, ticks = packed // tick_span, packed % tick_span
        first = np.ones(len(key), dtype=bool)
        first[1:] = key[1:] != key[:-1]
        ids, ticks = key[first] % max(nfiles, 1), ticks[first]
        epoch = ticks // max(steps, 1) - begin
        home = homes.node[ids]
        peer = (home != NO_HOME) & (home != node) & (homes.tick[ids] < ticks)
        nbytes = sizes[ids].astype(np.float64)
        for row, (mask, weights) in enumerate(
            [(None, None), (None, nbytes), (~peer, None), (~peer, nbytes), (peer, None),
             (peer, nbytes)]
        ):  # fmt: skip
            sel = epoch if mask is None else epoch[mask]
            w = None if weights is None else (weights if mask is None else weights[mask])
            figures[row] += np.bincount(sel, weights=w, minlength=nepochs).astype(np.int64)
    return EpochSources(*figures)
