"""`bench calibrate`'s epoch-boundary figures: what an epoch's start costs the ranks.

As an epoch starts every rank draws the epoch's sample order (hpcdl.data.sampler: with a global
shuffle a permutation of all samples), and each node's local rank 0 rewrites its node's plan
for the stager (hpcdl.staging.session: plan_for_node over the current and the next epoch, the
plan's text, its atomic write), while the other ranks wait for it at the next allreduce
(docs/cluster-model.md, equation 7). The job's --data is too small to show how these grow, so
they are timed on world rank 0 with a table of made-up names of ImageNet's length:

- permute_s_per_sample: one epoch's permutation of PERMUTED samples, the median of 3, per
  sample;
- replan_s and replan_s_per_entry: a line through the replan of a node of SMALL_NODES and of
  LARGE_NODES nodes (8 ranks each, batch 32, a global shuffle, the permutations already
  drawn as in a job), the median of 3 each, written into a temporary directory of
  --stage-dir (hpcdl.bench.stage_scratch) as the job writes its plan into the stage dir.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from hpcdl.bench.stage_scratch import scratch_dir
from hpcdl.data.dataset import FileTable
from hpcdl.data.sampler import SamplerSpec, epoch_rng, rank_layout
from hpcdl.staging.plan import plan_for_node, write_plan

PERMUTED = 1_000_000
TABLE = 200_000  # names in the made-up data set
PER_NODE, BATCH = 8, 32
SMALL_NODES, LARGE_NODES = 64, 4  # about 6,000 and 80,000 entries in a two-epoch plan
REPEATS = 3


@dataclass(frozen=True)
class BoundaryFigures:
    permute_s_per_sample: float
    replan_s: float
    replan_s_per_entry: float
    note: str


def _median_s(work, repeats: int = REPEATS) -> float:
    times = []
    for k in range(repeats):
        began = time.perf_counter()
        work(k)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def _table(count: int) -> SimpleNamespace:
    names = [f"train/n{i // 1300:08d}/n{i // 1300:08d}_{i:06d}.JPEG" for i in range(count)]
    files = FileTable.from_entries(names, [110_000] * count)
    return SimpleNamespace(root="/pfs/calibrate", files=files, file_ids=np.asarray)


def _replan(ds: SimpleNamespace, nodes: int, into: Path) -> tuple[float, int]:
    """(median seconds of one replan, its entries) for node 0 of a job of `nodes` nodes."""
    spec = SamplerSpec(len(ds.files), PER_NODE * nodes, 0, "global",
                       rank_layout([PER_NODE] * nodes))  # fmt: skip
    ranks = tuple(range(PER_NODE))
    plan = plan_for_node(ds, spec, BATCH, (1, 3), ranks, 0)  # draws (and keeps) both orders

    def replan(_: int) -> None:
        again = plan_for_node(ds, spec, BATCH, (1, 3), ranks, 0)
        write_plan(into / "plan", again, ds, "0" * 16, "calibrate")

    return _median_s(replan), plan.files


def measure_boundary(stage_dir: Path) -> BoundaryFigures:
    """The three figures, on this process (world rank 0)."""
    permute = _median_s(lambda k: epoch_rng(0, 1000 + k).permutation(PERMUTED)) / PERMUTED
    ds = _table(TABLE)
    with scratch_dir(stage_dir, ".hpcdl-calibrate-plan.") as into:
        small_s, small = _replan(ds, SMALL_NODES, into)
        large_s, large = _replan(ds, LARGE_NODES, into)
    per_entry = max(large_s - small_s, 0.0) / max(large - small, 1)
    fixed = max(small_s - per_entry * small, 0.0)
    note = (f"replans of {small} and {large} entries: {small_s * 1e3:.1f} and "
            f"{large_s * 1e3:.1f} ms")  # fmt: skip
    return BoundaryFigures(permute, fixed, per_entry, note)
