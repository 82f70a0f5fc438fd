"""The peer tier in the cluster model (issue 35): the [peer] calibration table, the PFS/peer
split per epoch (expected against one exact draw), the peer fetch term and the dry run."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import stage_cli

from hpcdl.clustermodel import calibration, equations, peers
from hpcdl.clustermodel.calibration import (
    DEFAULT_PEER,
    Calibration,
    CalibrationError,
    ComputeFigures,
    LocalFigures,
    NetworkFigures,
    PeerFigures,
    PfsFigures,
)
from hpcdl.clustermodel.equations import JobShape
from hpcdl.clustermodel.prediction import DescribedDataset, PredictionRequest, predict
from hpcdl.staging.plan import FileTreeDataset

REPO = Path(__file__).resolve().parents[1]

CAL = Calibration(
    pfs=PfsFigures(open_latency_s=0.01, thread_bandwidth_Bps=1e8),
    local=LocalFigures(write_bandwidth_Bps=1e9),
    network=NetworkFigures(1e-5, 1e-9, 1e-4, 1e-8, "hierarchical"),
    compute=ComputeFigures(
        "mlp", 8, v0=8000.0, t=0.001, backward_fraction=0.5, gradient_bytes=4_000
    ),  # fmt: skip
    peer=PeerFigures(fetch_latency_s=0.001, thread_bandwidth_Bps=1e8, node_bandwidth_Bps=5e7),
)


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tree")
    for i in range(1000):
        (root / f"f{i:04d}").write_bytes(b"x" * 1000)
    return root


def test_a_file_without_a_peer_table_loads_with_the_stated_default(tmp_path):
    path = tmp_path / "old.toml"
    calibration.save(path, replace(CAL, peer=None))
    assert "[peer]" not in path.read_text()
    old = calibration.load(path)
    assert old.peer is None
    used = calibration.peer_figures(old)
    assert used.fetch_latency_s == DEFAULT_PEER.fetch_latency_s
    assert used.node_bandwidth_Bps == pytest.approx(1e8)  # the link: 1 / inter_beta
    calibration.save(path, CAL)
    assert calibration.load(path) == CAL
    # the node's figure never passes the link between nodes
    fast = replace(CAL, peer=replace(CAL.peer, node_bandwidth_Bps=1e12))
    assert calibration.peer_figures(fast).node_bandwidth_Bps == pytest.approx(1e8)
    path.write_text(CAL.to_toml().replace("fetch_latency_s", "fetch_latncy_s"))
    with pytest.raises(CalibrationError, match=r"\[peer\]: unknown field fetch_latncy_s"):
        calibration.load(path)


def test_peer_fetch_seconds_are_a_roofline_of_threads_link_and_disk():
    assert peers.peer_fetch_s(CAL, 8, 0, 1e5) == 0.0
    per_file = 0.001 + 1e5 / 1e8
    # 8 threads / 2 ms = 4,000 files/s; the node's 50 MB/s at 100 kB = 500 files/s: the link
    assert peers.peer_fetch_s(CAL, 8, 101, 1e5) == pytest.approx(per_file + 100 / 500)
    small = peers.peer_fetch_s(CAL, 8, 101, 1e3)  # 8 / 1.01 ms: the threads
    assert small == pytest.approx(0.00101 + 100 / (8 / 0.00101))


def test_expected_pfs_shares_follow_an_exact_draw(tree):
    """The (q / (1 - f))^e shares against staging.peers.epoch_sources on a real tree: 1,000
    files, 4 nodes x 2 ranks x batch 30 read 960 per epoch (4 % dropped)."""
    expected = peers.pfs_shares(1000, 4, 2, 30, 3, "global")
    assert expected[0] == 1.0
    assert expected[1] == pytest.approx(0.04 / 0.76)
    request = PredictionRequest(
        calibration=CAL, source="test", dataset=FileTreeDataset(tree), node_counts=(4,),
        ranks_per_node=2, batch_size=30, epochs=3, stage_threads=8, seed=0, shuffle="global",
        placement="block",
    )  # fmt: skip
    exact = peers_of(request)
    assert exact.peer_tier and exact.peer_files_per_epoch[0] == 0
    # every copy of a later epoch comes from a peer unless no node read the file before
    total = [p + q for p, q in zip(exact.pfs_opens_per_epoch[1:], exact.peer_files_per_epoch[1:])]
    shares = [p / t for p, t in zip(exact.pfs_opens_per_epoch[1:], total)]
    assert all(abs(s - e) < 0.04 for s, e in zip(shares, expected[1:])), (shares, expected)
    off = peers_of(replace(request, peer_staging="off"))
    assert not off.peer_tier and off.peer_files_per_epoch == [0, 0, 0]
    assert off.pfs_opens_per_epoch[1] > 5 * exact.pfs_opens_per_epoch[1]
    node = peers_of(replace(request, shuffle="node"))  # auto: no peers with a node shuffle
    assert not node.peer_tier


def peers_of(request: PredictionRequest) -> equations.Prediction:
    (row,) = predict(request)
    return row


def test_the_peer_term_shortens_input_bound_later_epochs():
    """A job whose later epochs wait for the PFS: with peers they wait for the peer fetches,
    the PFS share at the staging rate plus the peers' term (equation 5)."""
    slow = replace(CAL, pfs=replace(CAL.pfs, open_latency_s=0.05))
    shape = JobShape(nodes=8, ranks_per_node=2, batch_size=8, epochs=3, stage_threads=4)
    reads = equations.analytic_reads(20_000, 20_000 * 10_000, shape)
    shares = peers.pfs_shares(20_000, 8, 2, 8, 3, "global")
    without = equations.predict_shape(slow, shape, reads)
    with_peers = equations.predict_shape(slow, shape, reads, None, shares)
    assert without.epoch_s[0] == with_peers.epoch_s[0] == without.epoch1_s
    assert with_peers.later_epoch_s < without.later_epoch_s / 5
    split = peers.split_reads(reads.new_files, reads.new_bytes, shares)
    rate = equations.staging_rate_for(slow, shape, reads.mean_file_bytes)
    step = equations.step_time(slow, shape).step_s * reads.steps_per_epoch
    expected = equations.staged_at(rate, split.pfs_files[1]) + peers.peer_fetch_s(
        slow, 4, split.peer_files[1], split.peer_bytes[1] / split.peer_files[1]
    )
    assert with_peers.epoch_s[1] == pytest.approx(max(step, expected))
    assert with_peers.pfs_opens_per_epoch[1] + with_peers.peer_files_per_epoch[1] == pytest.approx(
        without.pfs_opens_per_epoch[1], abs=8
    )
    assert without.time_to_last_epoch_s == pytest.approx(without.index_s + sum(without.epoch_s))


def test_dry_run_says_the_peer_tier_and_its_figures_per_epoch(tmp_path):
    path = tmp_path / "c.toml"
    calibration.save(path, replace(CAL, peer=None))
    args = ["--dry-run", "--calibration", str(path), "--dataset-files", "100000",
            "--dataset-bytes", "1e9", "--nodes", "1,16", "--ranks-per-node", "2", "--epochs",
            "3", "--json"]  # fmt: skip
    proc = stage_cli(*args, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert (
        "peer tier on in rows of 2+ nodes (--peer-staging auto; fetches: defaults, no [peer]"
        in proc.stdout
    )
    one, many = json.loads(proc.stdout.splitlines()[-1])["predictions"]
    assert not one["peer_tier"] and many["peer_tier"]
    assert many["peer_files_per_epoch"][1] > 10 * many["pfs_opens_per_epoch"][1]
    assert len(many["epoch_s"]) == 3
    off = stage_cli(*args, "--peer-staging", "off", cwd=REPO)
    assert "peer tier off (--peer-staging off" in off.stdout
    rows = json.loads(off.stdout.splitlines()[-1])["predictions"]
    assert rows[1]["peer_files_per_epoch"] == [0, 0, 0]


def test_peer_calibration_fetches_between_two_real_stagers_and_leaves_nothing(tmp_path):
    from hpcdl.bench.calibrate_peer import measure_peer

    (tmp_path / "mine").write_text("a user's file")
    peer = measure_peer(tmp_path)
    assert 0 < peer.fetch_latency_s < 1.0 and peer.thread_bandwidth_Bps > 1e6
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]
    assert (tmp_path / "mine").read_text() == "a user's file"


def test_peer_calibration_says_at_once_why_its_home_stager_staged_nothing(tmp_path, monkeypatch):
    """Bug: on a stage dir with less free space than the stager keeps free (max(5 %, 1 GiB): a
    capacity of 0 B), bench calibrate waited its 60 s for the home stager, then said only "the
    home stager did not stage its files". It now stops at once and says what the stager said."""
    from hpcdl.bench import calibrate_peer
    from hpcdl.comm.failure import UserError

    start = calibrate_peer.start_stager

    def no_room(stage, secret, flags, listener, threads=1):  # the home: as on a full disk
        return start(stage, secret, [*flags, "--capacity", "0"] if listener else flags,
                     listener, threads)  # fmt: skip

    monkeypatch.setattr(calibrate_peer, "start_stager", no_room)
    began = time.monotonic()
    with pytest.raises(UserError) as caught:
        calibrate_peer.measure_peer(tmp_path)
    assert time.monotonic() - began < calibrate_peer.WAIT_S / 4
    message = str(caught.value)
    assert "do not fit the stage capacity of 0 B" in message, message
    assert str(tmp_path) in message, message
    assert list(tmp_path.iterdir()) == []


def test_peer_calibration_bounds_a_bandwidth_lost_in_the_start_up_spread(tmp_path, monkeypatch):
    """Bug: when the large files' fetches hid in the stagers' start-up spread, the fit's per-byte
    slope came out negative and the table said 0 B/s, so the model put ~1e13 s on a peer epoch.
    The bandwidth is then bounded by the fastest group's bytes per second instead."""
    from hpcdl.bench import calibrate_peer

    seconds = iter([0.056, 0.133, 0.088, 0.0254, 0.0262, 0.0255])  # as measured on a quiet VM
    monkeypatch.setattr(calibrate_peer, "fetch_seconds", lambda *_: next(seconds))
    peer = calibrate_peer.measure_peer(tmp_path)
    largest = max(size * count for size, count in calibrate_peer.GROUPS)
    assert peer.thread_bandwidth_Bps == pytest.approx(largest / 0.0255)
    assert 0 < peer.fetch_latency_s < 0.01


def test_projection_with_peers_gives_a_global_shuffle_the_node_shuffles_later_epochs():
    """docs/multinode.md's 128-node row: with peers a global shuffle's later epochs are the
    node shuffle's (step-bound) but for their start (equation 7: the draw of all samples, a
    plan twice as long), without them the metadata servers' (9.2 s)."""
    cal = calibration.load(REPO / "docs/calibrations/imagenet-lustre-a100.toml")
    base = PredictionRequest(
        calibration=cal, source="t", dataset=DescribedDataset(1281167, 140e9),
        node_counts=(128,), ranks_per_node=8, batch_size=32, epochs=90, stage_threads=32,
        seed=0, shuffle="global", placement="block",
    )  # fmt: skip
    off = peers_of(replace(base, peer_staging="off"))
    on = peers_of(base)
    node = peers_of(replace(base, shuffle="node"))
    assert off.later_epoch_s == pytest.approx(9.2, abs=0.05)
    assert on.epoch_start_s > node.epoch_start_s > 0
    assert on.later_epoch_s == pytest.approx(
        node.later_epoch_s + on.epoch_start_s - node.epoch_start_s, rel=0.01
    )
    assert on.pfs_opens_total < 1.01 * node.pfs_opens_total
    assert on.pfs_opens_total + sum(on.peer_files_per_epoch) == pytest.approx(
        off.pfs_opens_total, abs=128 * 90
    )


def test_calibrate_on_two_nodes_picks_the_algorithm_its_timings_follow():
    """bench calibrate's last network step on 2+ nodes (it failed with an ImportError once the
    cluster model became a package, so every multi-node calibration failed)."""
    from types import SimpleNamespace

    from hpcdl.bench.calibrate import SIZES, closest_algorithm

    net = CAL.network
    world = SimpleNamespace(num_nodes=2, node_comm=SimpleNamespace(size=2))  # the two sizes
    ring = [equations.allreduce_s(net, 2, 2, n)["ring"] for n in SIZES]
    fitted = closest_algorithm(net, world, ring)
    assert fitted.algorithm == "ring" and fitted.algorithm_factor == pytest.approx(1.0)
