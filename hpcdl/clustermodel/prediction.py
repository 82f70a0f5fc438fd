"""The dry run's predictions: `python -m hpcdl.stage --dry-run --calibration FILE --nodes 2,4,...`.

For each node count it takes what every node reads from the staging plan (exactly, through
hpcdl.staging.plan.plan_for_node for every node) or, where that would cost more than
PLAN_BUDGET, from the expected values of the shuffle (equations.analytic_reads); the table
says which. The cost counted is the planner's: plan_for_node draws one permutation of the data
set per epoch for each node, so nodes x epochs x samples. Then equations.predict_shape predicts
PFS load, staging, allreduce and time to train of each job shape. Equations:
docs/cluster-model.md. The dry run asks through one typed PredictionRequest; `predict(request)`
gives one Prediction per node count.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from hpcdl.clustermodel import equations, packed, peers
from hpcdl.clustermodel.calibration import Calibration
from hpcdl.clustermodel.equations import JobShape, NodeReads, Prediction
from hpcdl.data.sampler import SamplerSpec, rank_layout
from hpcdl.staging.peer_tier import peer_tier_wanted
from hpcdl.staging.peers import epoch_sources
from hpcdl.staging.plan import plan_for_node

PLAN_BUDGET = 200_000_000  # nodes x epochs x samples the exact plans may cost per row


class DescribedDataset:
    """A data set given by its size only (--dataset-files, --dataset-bytes): the model takes
    every node's reads analytically, since there are no files to plan."""

    index_source = "built"

    def __init__(self, files: int, nbytes: float) -> None:
        if files < 1 or nbytes <= 0:
            raise ValueError("--dataset-files and --dataset-bytes must be positive")
        self.num_files, self.nbytes = files, int(nbytes)

    def __len__(self) -> int:
        return self.num_files


def described_dataset(files: int, nbytes: float | None) -> DescribedDataset:
    if nbytes is None:
        raise ValueError("--dataset-files needs --dataset-bytes (the data set's bytes in all)")
    return DescribedDataset(int(files), float(nbytes))


@dataclass(frozen=True)
class PredictionRequest:
    """What the dry run asks the cluster model: this job on each of node_counts nodes."""

    calibration: Calibration
    source: str  # where the calibration came from (its file), for the header line
    dataset: Any  # a data set with .files, or a DescribedDataset
    node_counts: tuple[int, ...]
    ranks_per_node: int
    batch_size: int  # per rank
    epochs: int
    stage_threads: int
    seed: int
    shuffle: str  # the sampler's: global | node | none
    placement: str  # how the job places its ranks: block | cyclic
    peer_staging: str = "auto"  # --peer-staging: auto | on | off (staging.peer_tier)
    workers: int = 1  # the job's loader workers per rank (--workers; 0: the rank loads)
    checkpoint: bool = False  # the job has a --checkpoint-dir: every epoch ends with a checkpoint
    checkpoint_every: int = 0  # the job's --checkpoint-every (steps; 0: each epoch's end only)
    shards: int | None = None  # --shards: the data set stored as this many files (None: as is)


def dataset_figures(ds: Any) -> tuple[int, int]:
    """(files, bytes) of a data set."""
    if isinstance(ds, DescribedDataset):
        return ds.num_files, ds.nbytes
    return len(ds.files), int(ds.files.sizes.sum())


def _is_analytic(request: PredictionRequest, shape: JobShape) -> bool:
    ds = request.dataset
    return isinstance(ds, DescribedDataset) or shape.nodes * shape.epochs * len(ds) > PLAN_BUDGET


def _sampler(request: PredictionRequest, shape: JobShape) -> tuple[SamplerSpec, list]:
    layout = rank_layout([shape.ranks_per_node] * shape.nodes, request.placement)
    sampler = SamplerSpec(
        num_samples=len(request.dataset), world_size=shape.ranks, seed=request.seed,
        shuffle=request.shuffle, ranks_by_node=layout,
    )  # fmt: skip
    return sampler, layout


def pfs_shares(request: PredictionRequest, shape: JobShape) -> list[float] | None:
    """With the peer tier (as --peer-staging decides for this many nodes), per epoch the
    share of new files a node reads from the PFS: exact from every node's reads when the plans
    are within budget (staging.peers.epoch_sources), else expected (clustermodel.peers).
    None: no peer tier."""
    if not peer_tier_wanted(request.peer_staging, shape.nodes, request.shuffle):
        return None
    if _is_analytic(request, shape):
        files = dataset_figures(request.dataset)[0]
        return peers.pfs_shares(files, shape.nodes, shape.ranks_per_node, shape.batch_size,
                                shape.epochs, request.shuffle)  # fmt: skip
    sampler, layout = _sampler(request, shape)
    fits = [True] * shape.nodes  # the model's reads assume the capacity holds the run
    src = epoch_sources(request.dataset, sampler, shape.batch_size, (0, shape.epochs), layout,
                        fits)  # fmt: skip
    return peers.exact_shares(src.pfs_files, src.peer_files)


def node_reads(request: PredictionRequest, shape: JobShape) -> list[NodeReads]:
    """Every node's reads of a job of this shape, busiest first (most files in epoch 1);
    analytic: one entry, the expected node."""
    ds = request.dataset
    files, nbytes = dataset_figures(ds)
    if _is_analytic(request, shape):
        return [equations.analytic_reads(files, nbytes, shape, request.shuffle)]
    sampler, layout = _sampler(request, shape)
    reads = [
        equations.plan_reads(
            plan_for_node(ds, sampler, shape.batch_size, (0, shape.epochs), layout[n], n)
        )
        for n in range(shape.nodes)
    ]
    return sorted(reads, key=lambda r: (r.new_files[0], sum(r.new_files)), reverse=True)


def predict(request: PredictionRequest) -> list[Prediction]:
    """One Prediction per entry of request.node_counts (the dry run's --nodes); with
    request.shards, of the data set as that many shards (clustermodel.packed)."""
    files, nbytes = dataset_figures(request.dataset)
    shards = request.shards
    layout = None if shards is None else packed.packed_layout(shards, files, nbytes)
    built = getattr(request.dataset, "index_source", "cache") == "built"
    index_files = (layout.shards if layout else files) if built else 0  # the index opens each
    out = []
    for nodes in request.node_counts:
        shape = JobShape(
            nodes=nodes,
            ranks_per_node=request.ranks_per_node,
            batch_size=request.batch_size,
            epochs=request.epochs,
            stage_threads=request.stage_threads,
            index_files=index_files,
            workers=request.workers,
            samples=len(request.dataset),
            shuffle=request.shuffle,
            checkpoint=request.checkpoint,
            checkpoint_every=request.checkpoint_every,
        )
        if layout is not None:
            # ranges from the homes: a global shuffle's (with node, a node reads its own block)
            wanted = peer_tier_wanted(request.peer_staging, nodes, request.shuffle)
            tier = wanted and request.shuffle == "global"
            out.append(packed.predict_packed(request.calibration, shape, layout, tier))
            continue
        reads = node_reads(request, shape)
        every_node = reads if len(reads) == nodes else None
        shares = pfs_shares(request, shape)
        out.append(
            equations.predict_shape(request.calibration, shape, reads[0], every_node, shares)
        )
    return out


COLUMNS = (  # header, width, how a Prediction shows in it
    ("nodes", 6, lambda p: f"{p.nodes}"),
    ("files/node e1", 13, lambda p: f"{p.node_files_epoch1}"),
    ("PFS opens e1", 12, lambda p: f"{p.pfs_opens_per_epoch[0]}"),
    ("opens/s peak", 12, lambda p: f"{p.pfs_peak_opens_per_s:.0f}"),
    ("staged s", 9, lambda p: f"{p.staging_finish_s:.1f}"),
    ("needed s", 9, lambda p: f"{p.staging_needed_by_s:.1f}"),
    ("input-bound s", 13, lambda p: f"{p.epoch1_input_bound_s:.1f}"),
    ("ring ms", 8, lambda p: f"{p.allreduce_ring_s * 1e3:.1f}"),
    ("hier ms", 8, lambda p: f"{p.allreduce_hierarchical_s * 1e3:.1f}"),
    ("step ms", 8, lambda p: f"{p.step_s * 1e3:.1f}"),
    ("images/s", 10, lambda p: f"{p.images_per_s:.0f}"),
    ("eff", 5, lambda p: f"{p.efficiency:.2f}"),
    ("epoch1 s", 9, lambda p: f"{p.epoch1_s:.1f}"),
    ("PFS e2", 8, lambda p: _epoch2(p.pfs_opens_per_epoch)),
    ("peer e2", 8, lambda p: _epoch2(p.peer_files_per_epoch)),
    ("later s", 8, lambda p: f"{p.later_epoch_s:.1f}"),
    ("total", 9, lambda p: _duration(p.time_to_last_epoch_s)),
    ("reads", 8, lambda p: p.reads_source),
)


def _epoch2(per_epoch: list[int] | None) -> str:
    """Epoch 2's figure (all nodes), where later epochs differ with the peer tier."""
    return f"{per_epoch[1]}" if per_epoch and len(per_epoch) > 1 else "-"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _peer_state(request: PredictionRequest, predictions: list[Prediction]) -> str:
    """Which rows the peer tier is on in (--peer-staging, its default auto: 2+ nodes and a
    global shuffle), and where its figures come from."""
    on = [p.nodes for p in predictions if p.peer_tier]
    if not on:
        return f"off (--peer-staging {request.peer_staging}, shuffle {request.shuffle})"
    where = "the [peer] table" if request.calibration.peer else "defaults, no [peer] table"
    rows = "every row" if len(on) == len(predictions) else "rows of 2+ nodes"
    return f"on in {rows} (--peer-staging {request.peer_staging}; fetches: {where})"


def table(predictions: list[Prediction]) -> str:
    head = " ".join(f"{name:>{w}}" for name, w, _ in COLUMNS)
    rows = [" ".join(f"{show(p):>{w}}" for _, w, show in COLUMNS) for p in predictions]
    return "\n".join([head, *rows])


def print_predictions(request: PredictionRequest, as_json: bool) -> int:
    """The dry run with --calibration: a table, then (as_json) one JSON object."""
    cal = request.calibration
    predictions = predict(request)
    print(
        f"cluster model ({request.source}): {cal.compute.model}, batch {request.batch_size} per "
        f"rank, {request.ranks_per_node} ranks/node, {request.epochs} epochs, "
        f"{dataset_figures(request.dataset)[0]} {_stored(request)}; staging limited by "
        f"{predictions[0].staging_limit}; allreduce {cal.network.algorithm}; peer tier "
        f"{_peer_state(request, predictions)}"
    )
    print(table(predictions))
    if request.checkpoint:
        every = f" and every {request.checkpoint_every} steps" if request.checkpoint_every else ""
        cost = (
            f"{cal.compute.checkpoint_s:.3g} s each"
            if cal.compute.checkpoint_s
            else "0 s, not in the calibration (bench calibrate --checkpoint-dir)"
        )
        print(f"  checkpoints at each epoch's end{every}: {cost}")
    # waits under 1 % of the epoch (the first files of step 0) are not worth a line
    late = [p for p in predictions if p.epoch1_input_bound_s > 0.01 * p.epoch1_s]
    for p in late:
        print(
            f"  {p.nodes} nodes: epoch 1 is input-bound from step {p.first_late_step}: "
            f"{p.epoch1_input_bound_s:.3g} s of {p.epoch1_s:.3g} s wait for staging"
        )
    out: dict[str, Any] = {"calibration": cal.to_json(),
                           "predictions": [p.to_json() for p in predictions]}  # fmt: skip
    if request.shards is not None:  # the same job on the data set as a folder, beside it
        folder = predict(replace(request, shards=None))
        print(layout_comparison(folder, predictions))
        out["folder_predictions"] = [p.to_json() for p in folder]
    if as_json:
        print(json.dumps(out))
    return 0


def _stored(request: PredictionRequest) -> str:
    """How the header names the data set: its files, or its samples in --shards shards."""
    return "files" if request.shards is None else f"samples in {request.shards} shards"


def layout_comparison(folder: list[Prediction], shards: list[Prediction]) -> str:
    """The same job on the data set as a folder (one file per sample) and as shards, per node
    count, each figure as a pair (folder, shards): PFS opens of epoch 1 (the index's
    included), epoch 1's seconds, a later epoch's, their ratio, and the total."""
    rows = [
        f"folder vs {shards[0].layout} (each column: folder, then shards):",
        f"{'nodes':>6} {'PFS opens e1':>19} {'epoch1 s':>15} {'later s':>15} {'e1/later':>15} "
        f"{'total':>19}",
    ]
    for f, s in zip(folder, shards):
        rows.append(
            f"{f.nodes:>6} {f.pfs_opens_per_epoch[0]:>9} {s.pfs_opens_per_epoch[0]:>9} "
            f"{f.epoch1_s:>7.1f} {s.epoch1_s:>7.1f} {f.later_epoch_s:>7.1f} "
            f"{s.later_epoch_s:>7.1f} {_ratio(f.epoch1_s, f.later_epoch_s):>7} "
            f"{_ratio(s.epoch1_s, s.later_epoch_s):>7} {_duration(f.time_to_last_epoch_s):>9} "
            f"{_duration(s.time_to_last_epoch_s):>9}"
        )
    return "\n".join(rows)


def _ratio(first: float, later: float) -> str:
    return f"{first / later:.2f}" if later > 0 else "-"
