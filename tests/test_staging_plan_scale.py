"""The planners that scale (one permutation per epoch, all nodes at once) plan and report exactly
what the per-rank planner did before them (issue 29). The reference below is that planner."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import ShardDataset, make_tree

from hpcdl.clustermodel.calibration import PfsFigures
from hpcdl.clustermodel.equations import staged_at, staging_rate
from hpcdl.config import STAGE_THREADS, TrainConfig
from hpcdl.data.sampler import DistributedSampler, SamplerSpec, rank_layout
from hpcdl.stage import main as stage_main
from hpcdl.staging.plan import (
    FileTreeDataset,
    NodePlan,
    node_figures,
    plan_for_node,
    render_plan,
)

LAYOUTS = {
    "block": rank_layout([2, 2, 2], "block"),
    "cyclic": rank_layout([2, 2, 2], "cyclic"),
    "uneven-cyclic": rank_layout([3, 1, 2], "cyclic"),
}


def reference_plan(ds, spec: SamplerSpec, batch, epochs, ranks, node) -> NodePlan:
    """The planner before issue 29: one DistributedSampler (one permutation) per local rank."""
    begin, end = epochs
    samplers = [DistributedSampler(rank=r, **vars(spec)) for r in ranks]
    steps = samplers[0].steps_per_epoch(batch)
    used = steps * batch
    reads = np.empty((end - begin, steps, len(ranks), batch), dtype=np.int64)
    for e, epoch in enumerate(range(begin, end)):
        for local, sampler in enumerate(samplers):
            ids = np.asarray(ds.file_ids(sampler.indices(epoch)[:used]), dtype=np.int64)
            reads[e, :, local, :] = ids.reshape(steps, batch)
    flat = reads.reshape(-1)
    total = max(1, (end - begin) * steps)
    tick_of_read = np.repeat(np.arange((end - begin) * steps), len(ranks) * batch)
    uniq, first = np.unique(flat, return_index=True)
    file_ids = uniq[np.argsort(first, kind="stable")]
    pairs = np.unique(flat * total + tick_of_read)
    ticks = [
        pairs[pairs // total == f] % total for f in file_ids.tolist()
    ]  # slow and obvious: the uses of each file
    sizes = np.array([ds.files[f].size for f in file_ids.tolist()], dtype=np.int64)
    return NodePlan(
        node, file_ids, ticks, sizes, begin, end, steps, tuple(ranks), spec.seed, spec.shuffle
    )


def assert_same_plan(new: NodePlan, old: NodePlan) -> None:
    assert new.file_ids.tolist() == old.file_ids.tolist()
    assert [t.tolist() for t in new.ticks] == [t.tolist() for t in old.ticks]
    assert new.sizes.tolist() == old.sizes.tolist()
    assert (new.steps_per_epoch, new.ranks, new.epoch_begin, new.epoch_end) == (
        old.steps_per_epoch,
        old.ranks,
        old.epoch_begin,
        old.epoch_end,
    )


@pytest.mark.parametrize("shuffle", ["global", "node", "none"])
def test_rank_indices_are_each_ranks_sampler_indices(shuffle):
    layout = LAYOUTS["uneven-cyclic"]
    spec = SamplerSpec(num_samples=101, world_size=6, seed=5, shuffle=shuffle, ranks_by_node=layout)
    for epoch in (0, 3):
        rows = spec.rank_indices(epoch)
        for rank in range(6):
            assert rows[rank].tolist() == spec.for_rank(rank).indices(epoch).tolist()
        picked = spec.rank_indices(epoch, [4, 1])
        assert picked.tolist() == [rows[4].tolist(), rows[1].tolist()]


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
@pytest.mark.parametrize("shuffle", ["global", "node", "none"])
@pytest.mark.parametrize("per_file", [1, 3])
def test_node_plans_and_figures_match_the_per_rank_planner(
    tmp_path, layout_name, shuffle, per_file
):
    tree = make_tree(tmp_path, 90, 50)
    ds = ShardDataset(tmp_path, [f.relpath for f in tree.files], per_file=per_file)
    layout = LAYOUTS[layout_name]
    spec = SamplerSpec(len(ds), world_size=6, seed=11, shuffle=shuffle, ranks_by_node=layout)
    for epochs in [(0, 1), (1, 4)]:
        olds = [reference_plan(ds, spec, 4, epochs, r, n) for n, r in enumerate(layout)]
        for node, ranks in enumerate(layout):
            assert_same_plan(plan_for_node(ds, spec, 4, epochs, ranks, node), olds[node])
        figures = node_figures(ds, spec, 4, epochs, layout)
        assert figures.files.tolist() == [p.files for p in olds]
        assert figures.bytes.tolist() == [p.bytes for p in olds]


def model_staging_s(files: int, nbytes: int, latency_ms: float, mbps: float, threads: int):
    """The cluster model's staging time for one node's files, from the dry run's two figures."""
    pfs = PfsFigures(latency_ms / 1000, mbps * 1e6, node_bandwidth_Bps=mbps * 1e6)
    return float(staged_at(staging_rate(pfs, threads, 1, nbytes / max(files, 1)), files))


def reference_rows(ds, spec, batch, epochs, layout, capacity):
    """The dry run's per-node JSON rows as the per-rank planner computed them."""
    rows = []
    for node, ranks in enumerate(layout):
        first = reference_plan(ds, spec, batch, (0, 1), ranks, node)
        run = reference_plan(ds, spec, batch, (0, epochs), ranks, node)
        seconds = model_staging_s(first.files, first.bytes, 1.0, 1000.0, STAGE_THREADS)
        rows.append(
            dict(
                node=node,
                files=first.files,
                bytes=first.bytes,
                fits=first.bytes <= capacity,
                run_files=run.files,
                run_bytes=run.bytes,
                run_fits=run.bytes <= capacity,
                capacity=capacity,
                est_seconds=round(seconds, 3),
                pfs_open_latency_ms=1.0,
                pfs_mbps=1000.0,
            )
        )
    return rows


@pytest.mark.parametrize("placement", ["block", "cyclic"])
@pytest.mark.parametrize("shuffle", ["global", "node", "none"])
def test_dry_run_prints_what_the_per_rank_planner_printed(tmp_path, capsys, placement, shuffle):
    make_tree(tmp_path / "data", 200, 300)
    ds = FileTreeDataset(tmp_path / "data")
    layout = rank_layout([3] * 4, placement)
    spec = SamplerSpec(200, world_size=12, seed=2, shuffle=shuffle, ranks_by_node=layout)
    run_bytes = [reference_plan(ds, spec, 5, (0, 3), r, n).bytes for n, r in enumerate(layout)]
    capacity = sorted(run_bytes)[1]  # some nodes' whole run fits, some do not
    want = reference_rows(ds, spec, 5, 3, layout, capacity)
    plans = tmp_path / "plans"
    argv = [
        "--dry-run", "--files-only", "--data", str(tmp_path / "data"), "--nodes", "4",
        "--ranks-per-node", "3", "--placement", placement, "--batch-size", "5", "--seed", "2",
        "--shuffle", shuffle, "--epochs", "3", "--stage-capacity", str(capacity), "--json",
        "--write-plans", str(plans),
    ]  # fmt: skip
    assert stage_main(argv) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["nodes"]
    assert rows == want
    assert {r["run_fits"] for r in rows} == {True, False}
    for node, ranks in enumerate(layout):
        old = reference_plan(ds, spec, 5, (0, 1), ranks, node)
        assert (plans / f"plan.node{node}").read_text() == render_plan(old, ds)


def test_one_permutation_per_epoch_for_a_node_and_for_the_whole_job(tmp_path, monkeypatch):
    import hpcdl.data.sampler as sampler_module

    draws = []
    real = sampler_module.epoch_rng

    def counting(seed, epoch, stream=0):
        draws.append((epoch, stream))
        return real(seed, epoch, stream)

    monkeypatch.setattr(sampler_module, "epoch_rng", counting)
    ds = make_tree(tmp_path, 96, 10)
    layout = rank_layout([4] * 3, "block")
    spec = SamplerSpec(96, world_size=12, seed=1, shuffle="global", ranks_by_node=layout)
    plan_for_node(ds, spec, 2, (0, 3), layout[1], 1)
    assert draws == [(0, 0), (1, 0), (2, 0)]  # not one per local rank (4 x 3)
    draws.clear()
    node_figures(ds, spec, 2, (0, 3), layout)
    assert draws == [(0, 0), (1, 0), (2, 0)]  # not one per node and rank (12 x 3)


def dry_run_rows(capsys, *flags: str) -> list[dict]:
    assert stage_main(["--dry-run", "--files-only", "--json", *flags]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    return out, json.loads(out[-1])["nodes"]


def test_the_dry_run_estimates_staging_with_the_cluster_models_formula(tmp_path, capsys):
    """One formula: the slowest of the limits (here 200 MB/s of 100 KB files: 2,000 files/s,
    slower than 8 threads at 1.5 ms a file), not latency / threads plus bytes / bandwidth."""
    make_tree(tmp_path / "data", 64, 100_000)
    flags = ["--data", str(tmp_path / "data"), "--batch-size", "8", "--stage-threads", "8",
             "--pfs-open-latency", "1", "--pfs-bandwidth", "200"]  # fmt: skip
    _, (row,) = dry_run_rows(capsys, *flags)
    want = model_staging_s(row["files"], row["bytes"], 1.0, 200.0, 8)
    assert row["est_seconds"] == round(want, 3)
    assert row["est_seconds"] != round(row["files"] * 0.001 / 8 + row["bytes"] / 200e6, 3)


def test_the_dry_run_takes_the_trainers_epochs_by_default(tmp_path, capsys):
    """Left out, --epochs is hpcdl.train's default, so the whole-run figures are the run's."""
    make_tree(tmp_path / "data", 40, 1000)
    flags = [
        "--data",
        str(tmp_path / "data"),
        "--batch-size",
        "4",
        "--nodes",
        "2",
        "--stage-capacity",
        "1G",
    ]  # not the free space, which others change meanwhile
    out, rows = dry_run_rows(capsys, *flags)
    epochs = TrainConfig().epochs
    assert f"(whole run of {epochs} epochs)" in out[0]
    assert dry_run_rows(capsys, *flags, "--epochs", str(epochs))[1] == rows
    assert dry_run_rows(capsys, *flags, "--epochs", "1")[1] != rows
