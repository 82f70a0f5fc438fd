"""The peer tier's term of the cluster model (issue 35; docs/cluster-model.md, equation 5).

With the peer tier (docs/staging.md, "Peer tier") a node's new files of an epoch split in two:
those no node has staged before come from the PFS, the rest from the node that staged them
first (its home). This module gives the split per epoch and the seconds of the peer part; the
PFS part keeps the staging formula of hpcdl.clustermodel.equations (staging_rate, staged_at),
applied to the PFS files only, and the caller adds the two (the stager's copy threads do both
kinds of copy, one after another).

The split, for a global shuffle: each epoch one permutation of the D files is cut among all
ranks; the job reads C = steps x ranks x b of them and drops a share q = 1 - C / D. A node
reads F = C / N per epoch (a share f = F / D). A file the node has not read in e earlier epochs
is, by independence of the epochs' permutations, unread by every node with probability
(q / (1 - f))^e: that is the PFS share of the node's new files in epoch e, and 1 minus it the
peer share. In epoch 1 nothing is staged yet: all from the PFS. With `--shuffle node` or
`none` a node never reads another node's files, so nothing comes from peers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hpcdl.clustermodel.calibration import Calibration, peer_figures


@dataclass(frozen=True)
class PeerSplit:
    """One node's new files of every epoch, by where they come from (files, and bytes)."""

    pfs_files: tuple[int, ...]
    pfs_bytes: tuple[int, ...]
    peer_files: tuple[int, ...]
    peer_bytes: tuple[int, ...]


def no_peers(new_files: tuple[int, ...], new_bytes: tuple[int, ...]) -> PeerSplit:
    """Without the peer tier every new file comes from the PFS."""
    zeros = tuple(0 for _ in new_files)
    return PeerSplit(new_files, new_bytes, zeros, zeros)


def pfs_shares(
    files: int, nodes: int, ranks_per_node: int, batch_size: int, epochs: int, shuffle: str
) -> list[float]:
    """Per epoch, the expected share of a node's new files that come from the PFS with the
    peer tier on (the module docstring's (q / (1 - f))^e)."""
    if shuffle != "global" or nodes < 2:
        return [1.0] * epochs
    ranks = nodes * ranks_per_node
    read = (files // ranks) // batch_size * ranks * batch_size  # C
    dropped = 1.0 - read / files  # q
    node_share = read / nodes / files  # f
    ratio = dropped / (1.0 - node_share) if node_share < 1.0 else 0.0
    return [ratio**e for e in range(epochs)]


def split_reads(
    new_files: tuple[int, ...], new_bytes: tuple[int, ...], shares: list[float]
) -> PeerSplit:
    """Split a node's new files per epoch by the PFS share of each epoch (rounded to files)."""
    pfs = [int(round(n * s)) for n, s in zip(new_files, shares)]
    mean = [b / n if n else 0.0 for n, b in zip(new_files, new_bytes)]
    peer = [n - p for n, p in zip(new_files, pfs)]
    return PeerSplit(
        tuple(pfs),
        tuple(int(p * m) for p, m in zip(pfs, mean)),
        tuple(peer),
        tuple(int(p * m) for p, m in zip(peer, mean)),
    )


def exact_shares(pfs_files: np.ndarray, peer_files: np.ndarray) -> list[float]:
    """PFS shares per epoch from the dry run's exact counts of all nodes
    (hpcdl.staging.peers.epoch_sources), applied to the busiest node as to every node."""
    total = pfs_files + peer_files
    return [float(p / t) if t else 1.0 for p, t in zip(pfs_files.tolist(), total.tolist())]


def peer_fetch_s(cal: Calibration, threads: int, files: int, mean_bytes: float) -> float:
    """Seconds one node's stager (`threads` copy threads) takes to fetch `files` copies of
    mean_bytes from peers while every node does the same: a roofline as for the PFS, of the
    copy threads (one fetch costs the latency and the bytes at one thread's bandwidth), the
    node's link and the local disk. The first copy lands after one fetch, the rest at the
    limiting rate."""
    if files <= 0:
        return 0.0
    peer = peer_figures(cal)
    per_file = peer.fetch_latency_s + mean_bytes / max(peer.thread_bandwidth_Bps, 1e-9)
    size = max(mean_bytes, 1.0)
    limits = [threads / per_file]
    if peer.node_bandwidth_Bps > 0:
        limits.append(peer.node_bandwidth_Bps / size)
    if cal.local.write_bandwidth_Bps > 0:
        limits.append(cal.local.write_bandwidth_Bps / size)
    return per_file + (files - 1) / min(limits)
