"""The cluster model's packed layout (hpcdl.clustermodel.packed; docs/cluster-model.md,
section 6): a data set as S shards, opens per shard, bytes at the PFS rate, and the dry run's
--shards with its folder-vs-shards comparison."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import stage_cli

from hpcdl.clustermodel import calibration, packed, prediction
from hpcdl.clustermodel.calibration import (
    Calibration,
    ComputeFigures,
    LocalFigures,
    NetworkFigures,
    PfsFigures,
)
from hpcdl.clustermodel.equations import JobShape

REPO = Path(__file__).resolve().parents[1]
IMAGENET_CAL = REPO / "docs" / "calibrations" / "imagenet-lustre-a100.toml"
IMAGENET = (1_281_167, 140e9)  # samples, bytes: docs/multinode.md's projection

CAL = Calibration(
    pfs=PfsFigures(open_latency_s=0.01, thread_bandwidth_Bps=1e8),
    local=LocalFigures(write_bandwidth_Bps=0.0),
    network=NetworkFigures(1e-5, 1e-9, 1e-4, 1e-8, "hierarchical"),
    compute=ComputeFigures(
        "mlp", 8, v0=800.0, t=0.01, backward_fraction=0.5, gradient_bytes=4_000_000
    ),  # fmt: skip
)


def request(nodes: tuple[int, ...], shards: int | None, **kw) -> prediction.PredictionRequest:
    """The docs' ImageNet-1k projection (8 ranks x batch 32 per node, 32 copy threads)."""
    fields = dict(
        calibration=calibration.load(IMAGENET_CAL), source="docs",
        dataset=prediction.described_dataset(*IMAGENET), node_counts=nodes, ranks_per_node=8,
        batch_size=32, epochs=90, stage_threads=32, seed=0, shuffle="global",
        placement="block", shards=shards,
    )  # fmt: skip
    fields.update(kw)
    return prediction.PredictionRequest(**fields)


def test_without_peers_a_node_opens_each_shard_it_touches_once_whole():
    layout = packed.packed_layout(100, 10_000, 10**9)  # 100 samples, 10 MB a shard
    shape = JobShape(nodes=4, ranks_per_node=2, batch_size=5, epochs=3, stage_threads=4)
    p = packed.predict_packed(CAL, shape, layout, peer_tier=False)
    # a node reads F = 2,500 samples an epoch; a shard's 100 are all missed w.p. (3/4)^100
    touched = math.ceil(100 * (1 - (1 - 2500 / 10_000) ** 100))
    assert p.node_files_epoch1 == touched == 100
    assert p.node_bytes_epoch1 == touched * 10**7  # whole shards
    assert p.pfs_opens_per_epoch == [4 * touched, 0, 0]  # each node once; all held after
    assert p.peer_files_per_epoch == [0, 0, 0] and p.layout == "shards:100"


def test_shard_bytes_come_at_the_pfs_rate():
    # a 100 MB/s thread, a 1 GB/s file system shared by 4 nodes: 250 MB/s a node
    cal = replace(CAL, pfs=replace(CAL.pfs, total_bandwidth_Bps=1e9))
    layout = packed.packed_layout(40, 4_000, 4 * 10**9)  # 100 MB a shard
    shape = JobShape(nodes=4, ranks_per_node=1, batch_size=10, epochs=2, stage_threads=8)
    p = packed.predict_packed(cal, shape, layout, peer_tier=False)
    assert p.staging_limit == "shared PFS bandwidth"
    assert p.staging_files_per_s == pytest.approx(1e9 / 4 / 1e8)  # shards/s a node
    # all 40 shards streamed at once by the 8 threads: their bytes at the node's share
    assert p.node_files_epoch1 == 40
    assert p.staging_finish_s == pytest.approx(40 * 1e8 / (1e9 / 4))


def test_one_sample_per_shard_opens_what_the_folder_opens():
    folder = prediction.predict(request((8, 128), None, peer_staging="off", epochs=4))
    shards = prediction.predict(request((8, 128), IMAGENET[0], peer_staging="off", epochs=4))
    for f, s in zip(folder, shards):
        assert s.pfs_opens_per_epoch == pytest.approx(f.pfs_opens_per_epoch, rel=1e-3)
        assert s.epoch1_s == pytest.approx(f.epoch1_s, rel=0.02)


def test_with_the_peer_tier_each_shard_is_read_once_and_samples_fetched_as_ranges():
    (p,) = prediction.predict(request((128,), 1024))
    assert p.peer_tier and p.pfs_opens_per_epoch[0] == 1024 + 1024  # homes, and the index
    assert p.pfs_bytes_per_epoch[0] == pytest.approx(IMAGENET[1], rel=1e-3)
    assert p.node_files_epoch1 == 8  # S / N shards copied whole by each home
    node_samples = p.steps_per_epoch * 8 * 32
    assert p.peer_files_per_epoch[0] == pytest.approx(128 * node_samples * 127 / 128, rel=1e-3)
    assert p.pfs_opens_per_epoch[1] == 0  # later epochs come from peers


def test_node_shuffle_touches_only_the_nodes_block_of_shards():
    (p,) = prediction.predict(request((128,), 1024, shuffle="node"))
    assert not p.peer_tier
    assert p.node_files_epoch1 == 1024 // 128 + 1  # its block, straddling one boundary
    assert p.pfs_opens_per_epoch[1:] == [0] * 89


def test_imagenet_at_128_nodes_as_1024_shards_meets_the_goal_and_the_folder_is_unchanged():
    (folder,) = prediction.predict(request((128,), None, peer_staging="off"))
    assert round(folder.epoch1_s, 1) == 12.8  # docs/multinode.md's row
    assert round(folder.epoch1_input_bound_s, 1) == 11.7
    (shards,) = prediction.predict(request((128,), 1024))
    assert shards.epoch1_s <= 1.5 * shards.later_epoch_s
    assert shards.epoch1_s < folder.epoch1_s / 5


def test_dry_run_compares_folder_and_shards_per_node_count():
    proc = stage_cli("--dry-run", "--calibration", IMAGENET_CAL, "--dataset-files", IMAGENET[0],
                     "--dataset-bytes", IMAGENET[1], "--nodes", "8,128", "--ranks-per-node", 8,
                     "--epochs", 90, "--stage-threads", 32, "--shards", 1024, "--json",
                     cwd=REPO)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "1281167 samples in 1024 shards" in lines[0]
    at = lines.index("folder vs shards:1024 (each column: folder, then shards):")
    row = lines[at + 3].split()
    assert row[:3] == ["128", "2559119", "2048"] and row[3] == "12.8"
    out = json.loads(lines[-1])
    assert [r["layout"] for r in out["predictions"]] == ["shards:1024", "shards:1024"]
    assert [r["layout"] for r in out["folder_predictions"]] == ["folder", "folder"]
    assert out["folder_predictions"][1]["epoch1_s"] == pytest.approx(12.8, abs=0.05)


@pytest.mark.parametrize(
    "args, line",
    [
        (("--shards", 0), "--shards 0: give the number of shard files, from 1 to the data "
                          "set's 1281167 samples"),
        (("--shards", 2_000_000), "--shards 2000000: give the number of shard files, from 1 "
                                  "to the data set's 1281167 samples"),
        (("--shards", 8, "--no-calibration"), "--shards (the data set as shards) is for "
                                              "--dry-run --calibration only"),
    ],
)  # fmt: skip
def test_a_bad_shards_value_is_one_clear_line(args, line):
    cal = [] if "--no-calibration" in args else ["--calibration", IMAGENET_CAL]
    flags = [a for a in args if a != "--no-calibration"]
    proc = stage_cli("--dry-run", *cal, "--dataset-files", IMAGENET[0], "--dataset-bytes",
                     IMAGENET[1], "--nodes", 8, *flags, cwd=REPO)  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"hpcdl.stage: error: {line}"]


def test_a_data_set_under_one_batch_of_every_rank_gives_a_row_of_no_steps():
    ds = prediction.described_dataset(1000, 1e8)  # 128 x 8 ranks x 32: no step
    rows = prediction.predict(request((1, 128), 10, dataset=ds, epochs=3))
    assert rows[1].steps_per_epoch == 0 and rows[1].epoch1_s == 0.0
    assert rows[1].pfs_opens_per_epoch == [10, 0, 0]  # the index only
    (folder,) = prediction.predict(request((128,), None, dataset=ds, epochs=3))
    assert folder.steps_per_epoch == 0 and folder.epoch1_s == 0.0
