"""The cluster model: PFS load, staging, allreduce and time to train of a job on N nodes.

Inputs: a calibration (hpcdl.clustermodel.calibration: PFS, node-local disk, interconnect,
step time), the job's shape (nodes, ranks per node, batch, epochs, stage threads, bucket
size), and what each node reads (NodeReads: from the staging plan, exactly, or analytically
for a global shuffle).
Every equation is written out in docs/cluster-model.md, in the order of the functions here:

1. staging rate of a node (a roofline of per-thread latency and bandwidth, node, file-system
   and metadata limits, and the local disk);
2. epoch 1: the step clock against the time each file is staged (loaders wait for staging);
3. allreduce per step (alpha-beta: ring, or hierarchical as Open MPI's coll_han does: trees
   inside and between nodes), bucket by bucket on one communication thread while backward
   runs (hpcdl.comm.reducer);
4. images/s, scaling efficiency, epoch times and time to the last epoch;
5. with the peer tier, a later epoch's staging is its PFS files at the rate of 1. plus its
   peer fetches (hpcdl.clustermodel.peers, a term of its own beside the staging formula);
6. the steps an epoch's copies slow down (contention_s: a measured cost per copy), and the
   wait for the batch where the loaders fall behind or the rank builds it (input_time);
7. each later epoch's start: the ranks draw its sample order, and each node's local rank 0
   rewrites its plan while the others wait (boundary_s);
8. the job's checkpoints: each epoch's, at a measured cost each (checkpoints_per_epoch).
(Section 6, a data set as shards, is hpcdl.clustermodel.packed, built on these functions.)

The speed model v(b) = b / (b / v0 + t) (hpcdl.clustermodel.speed) is the compute term: one
rank's step without communication takes b / v0 + t.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from hpcdl.clustermodel import peers
from hpcdl.clustermodel.calibration import Calibration, NetworkFigures, PfsFigures
from hpcdl.comm.reducer import plan_buckets

GRADIENT_ITEMSIZE = 4  # float32 gradients: the reducer's buckets are counted in elements


@dataclass(frozen=True)
class JobShape:
    nodes: int
    ranks_per_node: int
    batch_size: int  # per rank
    epochs: int
    stage_threads: int = 8
    bucket_mb: float = 25.0  # the reducer's bucket size (--bucket-mb)
    index_files: int = 0  # files the job's index opens (0: a cached index is found)
    index_threads: int = 32  # hpcdl.data.imagefolder.INDEX_THREADS
    lead_s: float = 0.0  # how long staging runs before the first step
    workers: int = 1  # loader worker processes per rank (--workers; 0: the rank builds batches)
    samples: int = 0  # the data set's samples, which a global shuffle permutes (0: not known)
    shuffle: str = "global"  # the sampler's: global | node | none
    checkpoint: bool = False  # the job writes checkpoints (--checkpoint-dir)
    checkpoint_every: int = 0  # ... and every this many steps besides each epoch's end

    @property
    def ranks(self) -> int:
        return self.nodes * self.ranks_per_node


@dataclass(frozen=True)
class NodeReads:
    """What one node reads from the PFS: per epoch, the files it needs for the first time."""

    new_files: tuple[int, ...]  # per epoch: files first needed in that epoch (PFS opens)
    new_bytes: tuple[int, ...]
    first_needed: np.ndarray  # (steps,) epoch 1: files first used at steps <= s, cumulative
    steps_per_epoch: int
    source: str  # "plan" (hpcdl.staging.plan) or "analytic" (global shuffle, expected values)

    @property
    def mean_file_bytes(self) -> float:
        return self.new_bytes[0] / max(self.new_files[0], 1)


def plan_reads(plan: Any) -> NodeReads:
    """Exact reads of one node from its staging plan (hpcdl.staging.plan.NodePlan over the
    job's epochs): a file is opened in the epoch of its first use, and never again (the
    capacity holds the run; eviction and re-reads are not modelled)."""
    steps = plan.steps_per_epoch
    epochs = plan.epoch_end - plan.epoch_begin
    first = plan.first_use()
    epoch_of = first // steps
    sizes = np.asarray(plan.sizes, dtype=np.int64)
    new = np.bincount(epoch_of, minlength=epochs)[:epochs]
    new_bytes = np.bincount(epoch_of, weights=sizes, minlength=epochs)[:epochs]
    in_first = np.bincount(first[epoch_of == 0], minlength=steps)[:steps]
    return NodeReads(
        tuple(int(n) for n in new),
        tuple(int(b) for b in new_bytes),
        np.cumsum(in_first),
        steps,
        "plan",
    )


def analytic_reads(files: int, nbytes: int, shape: JobShape, shuffle: str = "global") -> NodeReads:
    """Expected reads of one node. shuffle=global: one permutation per epoch cut for all
    ranks, so a node reads F = steps x R x b distinct files per epoch, and a file it has not
    read in e earlier epochs is new with probability (1 - F/D)^e. node/none: the node keeps
    its F files, all new in epoch 1."""
    steps = (files // shape.ranks) // shape.batch_size
    per_epoch = steps * shape.ranks_per_node * shape.batch_size
    keep = 1.0 - per_epoch / files if shuffle == "global" else 0.0
    new = tuple(int(round(per_epoch * keep**e)) for e in range(shape.epochs))
    mean = nbytes / files
    first = np.arange(1, steps + 1, dtype=np.int64) * shape.ranks_per_node * shape.batch_size
    return NodeReads(new, tuple(int(n * mean) for n in new), first, steps, "analytic")


# ---------------------------------------------------------------------- 1. staging rate


@dataclass(frozen=True)
class StagingRate:
    files_per_s: float  # one node, all copy threads
    per_file_s: float  # one copy thread: open + read of a mean file
    limit: str  # which term sets the rate


def staging_rate(
    pfs: PfsFigures, threads: int, nodes: int, mean_bytes: float, local_write_Bps: float = 0.0
) -> StagingRate:
    """Files/s one node stages while every node stages: the smallest of the limits.

    The one staging-time formula: the cluster model (from a calibration) and `hpcdl.stage
    --dry-run` (from --pfs-open-latency and --pfs-bandwidth, or --probe) both call it. The
    copy threads overlap one file's open with another's read, so the slowest limit sets the
    rate; latency and bandwidth do not add up (docs/staging.md, "Time estimate")."""
    per_file = pfs.open_latency_s + mean_bytes / max(pfs.thread_bandwidth_Bps, 1e-9)
    limits = {"open latency x threads": threads / per_file}
    size = max(mean_bytes, 1.0)
    if pfs.node_bandwidth_Bps > 0:
        limits["node PFS bandwidth"] = pfs.node_bandwidth_Bps / size
    if pfs.total_bandwidth_Bps > 0:
        limits["shared PFS bandwidth"] = pfs.total_bandwidth_Bps / size / nodes
    if pfs.total_opens_per_s > 0:
        limits["PFS metadata (opens/s)"] = pfs.total_opens_per_s / nodes
    if local_write_Bps > 0:
        limits["local disk write"] = local_write_Bps / size
    limit = min(limits, key=limits.__getitem__)
    return StagingRate(limits[limit], per_file, limit)


def staging_rate_for(cal: Calibration, shape: JobShape, mean_bytes: float) -> StagingRate:
    """staging_rate with a calibration's figures for one job shape."""
    return staging_rate(
        cal.pfs, shape.stage_threads, shape.nodes, mean_bytes, cal.local.write_bandwidth_Bps
    )


def staged_at(rate: StagingRate, count: np.ndarray | int) -> np.ndarray | float:
    """Seconds after staging starts at which the first `count` files are ready."""
    n = np.asarray(count, dtype=np.float64)
    return np.where(n > 0, rate.per_file_s + (n - 1) / rate.files_per_s, 0.0)


# ---------------------------------------------------------------------- 2. epoch 1


@dataclass(frozen=True)
class EpochOne:
    seconds: float  # epoch 1, first step to last
    input_bound_s: float  # of which waiting for staging
    staging_finish_s: float  # the epoch's files staged, from the stager's start
    needed_by_s: float  # when the step that first reads the last of them starts, never waiting
    first_late_step: int | None  # first step whose files are not all staged in time (None: none)


def epoch_one(reads: NodeReads, rate: StagingRate, step_s: float, lead_s: float) -> EpochOne:
    """Step clock against staging: step s starts when step s-1 ends and its files are staged."""
    ready = np.asarray(staged_at(rate, reads.first_needed), dtype=np.float64)  # (steps,)
    finish = float(staged_at(rate, reads.new_files[0]))
    return step_clock(ready, reads, step_s, lead_s, finish)


def step_clock(
    ready: np.ndarray, reads: NodeReads, step_s: float, lead_s: float, finish_s: float
) -> EpochOne:
    """Epoch 1 of steps that wait for their data: step s starts at max(end of step s-1,
    ready[s]), ready[s] being when everything steps <= s first read is on the node (the
    folder's staged_at, or the packed layout's, hpcdl.clustermodel.packed)."""
    clock, late = lead_s, None
    for s, at in enumerate(ready.tolist()):
        if at > clock and late is None:
            late = s
        clock = max(clock, at) + step_s
    seconds = clock - lead_s
    last = reads.first_needed[-1] if len(reads.first_needed) else 0  # no step: nothing read
    last_step = int(np.searchsorted(reads.first_needed, last))
    return EpochOne(
        seconds=seconds,
        input_bound_s=max(0.0, seconds - reads.steps_per_epoch * step_s),
        staging_finish_s=finish_s,
        needed_by_s=lead_s + last_step * step_s,
        first_late_step=late,
    )


# ---------------------------------------------------------------------- 3. allreduce


def ring_s(ranks: int, nbytes: float, alpha: float, beta: float) -> float:
    """Ring allreduce: 2(p-1) messages, 2(p-1)/p of the buffer through every link."""
    if ranks <= 1:
        return 0.0
    return 2 * (ranks - 1) * alpha + 2 * (ranks - 1) / ranks * nbytes * beta


def tree_s(ranks: int, nbytes: float, alpha: float, beta: float) -> float:
    """Reduce, then broadcast, each along a binomial tree: ceil(log2 p) rounds of the whole
    buffer apiece (what coll_han runs among the node leaders, and inside a node)."""
    if ranks <= 1:
        return 0.0
    return 2 * math.ceil(math.log2(ranks)) * (alpha + nbytes * beta)


def allreduce_s(net: NetworkFigures, nodes: int, per_node: int, nbytes: float) -> dict[str, float]:
    """Seconds of one allreduce of nbytes. ring: over all ranks, the slowest link (between
    nodes) setting the pace. hierarchical (Open MPI 5's default across nodes, coll_han): reduce
    inside the node, reduce + broadcast among one leader per node, broadcast inside the node.
    The calibrated algorithm's figure is scaled by net.algorithm_factor (what the whole world's
    allreduce measured against its formula)."""
    intra_ring = ring_s(per_node, nbytes, net.intra_alpha_s, net.intra_beta_s_per_B)
    if nodes == 1:
        return {"ring": intra_ring, "hierarchical": intra_ring}
    times = {
        "ring": ring_s(nodes * per_node, nbytes, net.inter_alpha_s, net.inter_beta_s_per_B),
        "hierarchical": tree_s(per_node, nbytes, net.intra_alpha_s, net.intra_beta_s_per_B)
        + tree_s(nodes, nbytes, net.inter_alpha_s, net.inter_beta_s_per_B),
    }
    times[net.algorithm] *= net.algorithm_factor
    return times


@dataclass(frozen=True)
class StepTime:
    compute_s: float  # forward + backward + update, one rank (b / v0 + t)
    allreduce_s: dict[str, float]  # all buckets back to back, per algorithm
    exposed_s: float  # communication left after backward, with the calibrated algorithm
    step_s: float
    input_s: float = 0.0  # of step_s, waiting for the batch (input_time)


def input_time(cal: Calibration, shape: JobShape, busy_s: float) -> float:
    """Seconds a step waits for its batch: all of the batch's loading where the rank builds it
    (--workers 0); with K workers, each builds every K-th batch while the rank computes, so
    the rank waits only where one batch takes longer than K steps (the workers' cores are
    their own, as hpcdl.data.loader.default_workers leaves them)."""
    load = shape.batch_size * cal.compute.input_s_per_sample
    if shape.workers <= 0:
        return load
    return max(0.0, load / shape.workers - busy_s)


def step_time(cal: Calibration, shape: JobShape) -> StepTime:
    """One step: the batch (input_time), then buckets become ready as backward proceeds
    (uniformly over its share of the step) and one thread reduces them in order; the step
    waits for the last one. No collective of its own after that: the loss's finiteness flag
    rides in the last bucket (hpcdl.nn.step, NOTE [device scalars])."""
    compute = cal.compute.step_s(shape.batch_size)
    elements = max(1, cal.compute.gradient_bytes // GRADIENT_ITEMSIZE)
    buckets = plan_buckets(elements, GRADIENT_ITEMSIZE, shape.bucket_mb)
    per_algo = {"ring": 0.0, "hierarchical": 0.0}
    backward_start = compute * (1.0 - cal.compute.backward_fraction)
    done = 0.0
    for bucket in buckets:
        nbytes = (bucket.hi - bucket.lo) * GRADIENT_ITEMSIZE
        times = allreduce_s(cal.network, shape.nodes, shape.ranks_per_node, nbytes)
        for name, t in times.items():
            per_algo[name] += t
        ready = backward_start + compute * cal.compute.backward_fraction * bucket.hi / elements
        done = max(done, ready) + times[cal.network.algorithm]
    if shape.ranks == 1:
        wait = input_time(cal, shape, compute)
        return StepTime(compute, per_algo, 0.0, compute + wait, wait)
    exposed = max(0.0, done - compute)
    busy = compute + exposed
    wait = input_time(cal, shape, busy)
    return StepTime(compute, per_algo, exposed, busy + wait, wait)


# ---------------------------------------------------------------------- 4. the job


@dataclass(frozen=True)
class Prediction:
    nodes: int
    ranks_per_node: int
    reads_source: str
    steps_per_epoch: int
    node_files_epoch1: int
    node_bytes_epoch1: int
    node_new_files: list[int]  # per epoch, the busiest node
    every_node_new_files: list[list[int]] | None  # per node, per epoch (None: analytic reads)
    pfs_opens_per_epoch: list[int]  # all nodes (epoch 1 also counts the index)
    pfs_bytes_per_epoch: list[int]
    pfs_metadata_ops_per_epoch: list[int]  # open + close per file read
    pfs_opens_total: int
    pfs_peak_opens_per_s: float  # all nodes staging at once
    staging_files_per_s: float  # one node
    staging_limit: str
    staging_finish_s: float
    staging_needed_by_s: float  # the last epoch-1 file's first use, at the compute-bound pace
    epoch1_s: float
    epoch1_input_bound_s: float
    first_late_step: int | None
    compute_s: float
    allreduce_ring_s: float
    allreduce_hierarchical_s: float
    allreduce_exposed_s: float
    step_s: float
    images_per_s: float
    efficiency: float  # images/s over ranks x one rank's images/s without communication
    later_epoch_s: float
    index_s: float
    time_to_last_epoch_s: float
    # The peer tier (issue 35): per epoch, all nodes' copies from peers (zeros without it;
    # pfs_*_per_epoch above are then the PFS's share only) and every epoch's seconds.
    peer_tier: bool = False
    peer_files_per_epoch: list[int] | None = None
    peer_bytes_per_epoch: list[int] | None = None
    epoch_s: list[float] | None = None  # epoch 1 (from the first step) and every later one
    input_wait_s: float = 0.0  # of step_s, waiting for the batch (--workers, [compute] input)
    epoch_start_s: float = 0.0  # of a later epoch: its sample order and the plan's rewrite
    layout: str = "folder"  # the data set's files: folder (one per sample) or shards:S (packed)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def contention_s(cal: Calibration, split: peers.PeerSplit) -> list[float]:
    """Seconds the stager's copies take from each epoch's steps (equation 6): it copies epoch
    1's files and the next epoch's during epoch 1, the next epoch's during every later one,
    nothing during the last; a PFS copy costs contention_s_per_file, a peer fetch
    contention_s_per_fetch."""
    per_copy, per_fetch = cal.compute.contention_s_per_file, cal.compute.fetch_contention_s()
    cost = [per_copy * p + per_fetch * q for p, q in zip(split.pfs_files, split.peer_files)]
    ahead = [*cost[1:], 0.0]
    return [cost[0] + ahead[0], *ahead[1:]]


def boundary_s(cal: Calibration, shape: JobShape, node_files: int, replan: bool) -> float:
    """Seconds a later epoch's start holds the ranks (equation 7). Every rank draws the epoch's
    sample order: a permutation of all samples with a global shuffle, of its node's block with
    a node shuffle (hpcdl.data.sampler). Local rank 0 also rewrites its node's plan for this
    and the next epoch (replan; not in the last epoch), while the others wait for it at the
    next allreduce. That draws the next epoch's order, which its sampler then finds drawn, so
    it permutes as often as the others; the plan costs replan_s and replan_s_per_entry for each
    of its entries: the node's files of an epoch (node_files), twice with a global shuffle (at
    most: the two epochs share a 1/N part)."""
    c = cal.compute
    permuted = {"global": shape.samples, "node": shape.samples / max(shape.nodes, 1)}
    draw = c.permute_s_per_sample * permuted.get(shape.shuffle, 0)
    if not replan:
        return draw
    entries = node_files * (2 if shape.shuffle == "global" else 1)
    return draw + c.replan_s + c.replan_s_per_entry * entries


def checkpoints_per_epoch(shape: JobShape, steps_per_epoch: int) -> int:
    """Checkpoints hpcdl.train writes in an epoch (its checkpoint_due): one at the epoch's end,
    and one every checkpoint_every steps; the one due at the end is written once. The steps
    are counted from the epoch's start (the global step's multiples where epochs are a
    multiple of checkpoint_every long; within one either way)."""
    if not shape.checkpoint:
        return 0
    if shape.checkpoint_every <= 0:
        return 1
    every, rest = divmod(steps_per_epoch, shape.checkpoint_every)
    return every + (1 if rest else 0)


def later_epochs(
    cal: Calibration,
    shape: JobShape,
    rate: StagingRate,
    split: peers.PeerSplit,
    compute_epoch: float,
    node_files: int = 0,
) -> list[float]:
    """Seconds of every epoch after the first: the stager fetches each epoch's new files during
    the epoch before, so an epoch lasts its steps or its staging, whichever is longer; staging
    is the PFS files at the staging rate plus the peer fetches (equation 5). The steps are
    slowed by the copies made meanwhile (contention_s, equation 6) and held at the epoch's
    start (boundary_s, equation 7; node_files: the files a node reads in an epoch)."""
    slowed = contention_s(cal, split)
    out = []
    for e in range(1, shape.epochs):
        pfs_s = float(staged_at(rate, split.pfs_files[e]))
        n_peer = split.peer_files[e]
        mean = split.peer_bytes[e] / n_peer if n_peer else 0.0
        start = boundary_s(cal, shape, node_files, replan=e + 1 < shape.epochs)
        steps = compute_epoch + slowed[e] + start
        out.append(max(steps, pfs_s + peers.peer_fetch_s(cal, shape.stage_threads, n_peer, mean)))
    return out


def split_reads(reads: NodeReads, pfs_shares: list[float] | None) -> peers.PeerSplit:
    """A node's new files per epoch split between the PFS and its peers (pfs_shares: per
    epoch the PFS's share with the peer tier; None: no peer tier, all from the PFS)."""
    if pfs_shares:
        return peers.split_reads(reads.new_files, reads.new_bytes, pfs_shares)
    return peers.no_peers(reads.new_files, reads.new_bytes)


def epoch_times(
    cal: Calibration,
    shape: JobShape,
    reads: NodeReads,
    rate: StagingRate,
    step_s: float,
    pfs_shares: list[float] | None,
) -> tuple[EpochOne, float, list[float]]:
    """(epoch_one's figures, epoch 1's seconds, each later epoch's seconds) of the busiest
    node at its staging rate, the copies' contention and the checkpoints included."""
    compute_epoch = reads.steps_per_epoch * step_s
    split = split_reads(reads, pfs_shares)
    one = epoch_one(reads, rate, step_s, shape.lead_s)
    # the copies slow the steps; an epoch 1 that waits for staging anyway is not made longer
    epoch1_s = max(one.seconds, compute_epoch + contention_s(cal, split)[0])
    later = later_epochs(cal, shape, rate, split, compute_epoch, reads.new_files[0])
    later = later or [compute_epoch]
    # rank 0 writes the epoch's checkpoints after (or between) its steps, the others wait
    saving = checkpoints_per_epoch(shape, reads.steps_per_epoch) * cal.compute.checkpoint_s
    return one, epoch1_s + saving, [e + saving for e in later]


def job_reads(shape: JobShape, nodes: list[peers.PeerSplit]) -> dict[str, Any]:
    """Prediction's per-epoch totals over every node: PFS opens (the index's in epoch 1),
    bytes and metadata operations, and the files and bytes fetched from peers."""
    epochs = range(shape.epochs)
    opens = [sum(r.pfs_files[e] for r in nodes) for e in epochs]
    opens[0] += shape.index_files
    return dict(
        pfs_opens_per_epoch=opens,
        pfs_bytes_per_epoch=[sum(r.pfs_bytes[e] for r in nodes) for e in epochs],
        pfs_metadata_ops_per_epoch=[2 * n for n in opens],
        pfs_opens_total=sum(opens),
        peer_files_per_epoch=[sum(r.peer_files[e] for r in nodes) for e in epochs],
        peer_bytes_per_epoch=[sum(r.peer_bytes[e] for r in nodes) for e in epochs],
    )


def predict_shape(
    cal: Calibration,
    shape: JobShape,
    reads: NodeReads,
    every_node: list[NodeReads] | None = None,
    pfs_shares: list[float] | None = None,
) -> Prediction:
    """Every figure of the model for one job shape. reads: the busiest node's; every_node: all
    nodes' reads, for the PFS totals (None: N times the busiest node's, as for analytic reads);
    pfs_shares: with the peer tier, per epoch the share of new files from the PFS (None: no
    peer tier, all from the PFS)."""
    rate = staging_rate_for(cal, shape, reads.mean_file_bytes)
    step = step_time(cal, shape)
    timing = epoch_times(cal, shape, reads, rate, step.step_s, pfs_shares)
    nodes = [split_reads(r, pfs_shares) for r in (every_node or [reads] * shape.nodes)]
    peer_tier = pfs_shares is not None
    return assemble(cal, shape, reads, every_node, nodes, rate, step, timing, peer_tier)


def assemble(
    cal: Calibration,
    shape: JobShape,
    reads: NodeReads,
    every_node: list[NodeReads] | None,
    nodes: list[peers.PeerSplit],
    rate: StagingRate,
    step: StepTime,
    timing: tuple[EpochOne, float, list[float]],
    peer_tier: bool,
    layout: str = "folder",
) -> Prediction:
    """The Prediction of one job shape from its parts: the busiest node's reads (its PFS
    files per epoch), every node's split between the PFS and peers, the staging rate, the
    step, and epoch_times' (epoch 1's figures, epoch 1's seconds, the later epochs')."""
    one, epoch1_s, later = timing
    index_s = shape.index_files * cal.pfs.open_latency_s / max(shape.index_threads, 1)
    images = shape.ranks * shape.batch_size / step.step_s
    return Prediction(
        nodes=shape.nodes,
        ranks_per_node=shape.ranks_per_node,
        reads_source=reads.source,
        steps_per_epoch=reads.steps_per_epoch,
        node_files_epoch1=reads.new_files[0],
        node_bytes_epoch1=reads.new_bytes[0],
        node_new_files=list(reads.new_files),
        every_node_new_files=[list(r.new_files) for r in every_node] if every_node else None,
        **job_reads(shape, nodes),
        pfs_peak_opens_per_s=rate.files_per_s * shape.nodes,
        staging_files_per_s=rate.files_per_s,
        staging_limit=rate.limit,
        staging_finish_s=one.staging_finish_s,
        staging_needed_by_s=one.needed_by_s,
        epoch1_s=epoch1_s,
        epoch1_input_bound_s=one.input_bound_s,
        first_late_step=one.first_late_step,
        compute_s=step.compute_s,
        allreduce_ring_s=step.allreduce_s["ring"],
        allreduce_hierarchical_s=step.allreduce_s["hierarchical"],
        allreduce_exposed_s=step.exposed_s,
        step_s=step.step_s,
        images_per_s=images,
        efficiency=step.compute_s / step.step_s,
        later_epoch_s=float(np.mean(later)),
        index_s=index_s,
        time_to_last_epoch_s=index_s + epoch1_s + float(sum(later[: shape.epochs - 1])),
        peer_tier=peer_tier,
        epoch_s=[epoch1_s, *later[: shape.epochs - 1]],
        input_wait_s=step.input_s,
        epoch_start_s=boundary_s(cal, shape, reads.new_files[0], replan=shape.epochs > 2),
        layout=layout,
    )
