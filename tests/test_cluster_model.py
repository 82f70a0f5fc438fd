"""The cluster model's equations (hpcdl.clustermodel), its calibration file and the dry run."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from helpers import stage_cli

from hpcdl.clustermodel import calibration, equations
from hpcdl.clustermodel.calibration import (
    Calibration,
    CalibrationError,
    ComputeFigures,
    LocalFigures,
    NetworkFigures,
    PfsFigures,
)
from hpcdl.clustermodel.equations import JobShape
from hpcdl.data.sampler import SamplerSpec, rank_layout
from hpcdl.staging.plan import FileTreeDataset, plan_for_node

REPO = Path(__file__).resolve().parents[1]

CAL = Calibration(
    pfs=PfsFigures(open_latency_s=0.01, thread_bandwidth_Bps=1e8),
    local=LocalFigures(write_bandwidth_Bps=1e9),
    network=NetworkFigures(1e-5, 1e-9, 1e-4, 1e-8, "hierarchical"),
    compute=ComputeFigures(
        "mlp", 8, v0=800.0, t=0.01, backward_fraction=0.5, gradient_bytes=4_000_000
    ),  # fmt: skip
)


def test_ring_and_tree_follow_their_formulas():
    assert equations.ring_s(1, 1e6, 1.0, 1.0) == 0.0
    # 2(p-1) alpha + 2(p-1)/p n beta
    assert equations.ring_s(4, 1000, 0.5, 0.01) == pytest.approx(6 * 0.5 + 1.5 * 1000 * 0.01)
    # reduce + broadcast along binomial trees: 2 ceil(log2 p) (alpha + n beta)
    assert equations.tree_s(5, 1000, 0.5, 0.01) == pytest.approx(2 * 3 * (0.5 + 10))
    net = CAL.network
    one_node = equations.allreduce_s(net, 1, 4, 1e6)
    assert one_node["ring"] == one_node["hierarchical"] == equations.ring_s(4, 1e6, 1e-5, 1e-9)
    two = equations.allreduce_s(net, 2, 4, 1e6)
    assert two["hierarchical"] == pytest.approx(2 * 2 * (1e-5 + 1e-3) + 2 * 1 * (1e-4 + 1e-2))
    assert two["ring"] == pytest.approx(14 * 1e-4 + 2 * 7 / 8 * 1e6 * 1e-8)


def test_staging_rate_is_the_smallest_limit():
    shape = JobShape(nodes=4, ranks_per_node=2, batch_size=8, epochs=1, stage_threads=8)
    rate = equations.staging_rate_for(CAL, shape, mean_bytes=1e5)
    assert rate.per_file_s == pytest.approx(0.01 + 1e5 / 1e8)
    assert rate.files_per_s == pytest.approx(8 / 0.011) and rate.limit == "open latency x threads"
    capped = replace(CAL, pfs=replace(CAL.pfs, total_opens_per_s=1000.0))
    rate = equations.staging_rate_for(capped, shape, mean_bytes=1e5)
    assert rate.files_per_s == pytest.approx(250.0) and rate.limit == "PFS metadata (opens/s)"


def test_staging_ahead_of_the_steps_leaves_epoch_one_compute_bound():
    reads = equations.NodeReads((100,), (10**6,), np.arange(10, 101, 10), 10, "plan")
    fast = equations.StagingRate(files_per_s=1000.0, per_file_s=0.001, limit="x")
    one = equations.epoch_one(reads, fast, step_s=0.1, lead_s=0.1)
    assert one.input_bound_s == pytest.approx(0.0) and one.first_late_step is None
    assert one.seconds == pytest.approx(1.0)
    assert one.staging_finish_s == pytest.approx(0.001 + 99 / 1000)
    assert one.needed_by_s == pytest.approx(0.1 + 9 * 0.1)  # the last files: step 9


def test_slow_staging_makes_epoch_one_wait_for_the_last_files():
    reads = equations.NodeReads((100,), (10**6,), np.arange(10, 101, 10), 10, "plan")
    slow = equations.StagingRate(files_per_s=10.0, per_file_s=0.1, limit="x")
    one = equations.epoch_one(reads, slow, step_s=0.1, lead_s=0.0)
    # step s waits for file 10(s+1): ready at 0.1 + (10(s+1) - 1) / 10; the last step ends 0.1 later
    assert one.seconds == pytest.approx(0.1 + 99 / 10 + 0.1)
    assert one.first_late_step == 0
    assert one.input_bound_s == pytest.approx(one.seconds - 1.0)


def test_allreduce_hidden_behind_a_long_backward_is_not_exposed():
    slow_compute = replace(CAL, compute=replace(CAL.compute, v0=8.0, backward_fraction=0.9))
    shape = JobShape(nodes=2, ranks_per_node=2, batch_size=8, epochs=1, bucket_mb=1.0)
    step = equations.step_time(slow_compute, shape)
    assert step.compute_s == pytest.approx(1.01)
    last_bucket = equations.allreduce_s(CAL.network, 2, 2, 4_000_000 - 3 * (1 << 20))
    # only the bucket that becomes ready at the end of backward is left to wait for
    assert step.exposed_s == pytest.approx(last_bucket["hierarchical"], rel=1e-6)
    # no per-step loss check: the loss flags ride with the gradients (hpcdl.nn.step)
    assert step.step_s == pytest.approx(step.compute_s + step.exposed_s)
    alone = equations.step_time(CAL, replace(shape, nodes=1, ranks_per_node=1))
    assert alone.step_s == CAL.compute.step_s(8)


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tree")
    for i in range(400):
        (root / f"f{i:03d}").write_bytes(b"x" * (100 + i))
    return root


def test_reads_from_the_plan_count_each_nodes_files_once(tree):
    ds = FileTreeDataset(tree)
    layout = rank_layout([2, 2], "block")
    spec = SamplerSpec(num_samples=len(ds), world_size=4, seed=3, shuffle="global",
                       ranks_by_node=layout)  # fmt: skip
    plan = plan_for_node(ds, spec, 10, (0, 3), layout[1], 1)
    reads = equations.plan_reads(plan)
    assert sum(reads.new_files) == plan.files and sum(reads.new_bytes) == plan.bytes
    first_epoch = plan_for_node(ds, spec, 10, (0, 1), layout[1], 1)
    assert reads.new_files[0] == first_epoch.files == int(reads.first_needed[-1])
    assert len(reads.first_needed) == 10 and np.all(np.diff(reads.first_needed) >= 0)
    # the expected values of a global shuffle lie close to one draw of it
    shape = JobShape(nodes=2, ranks_per_node=2, batch_size=10, epochs=3)
    expected = equations.analytic_reads(len(ds), sum(f.size for f in ds.files), shape)
    assert expected.new_files[0] == reads.new_files[0] == 200
    assert expected.new_files[1:] == (100, 50)
    assert all(abs(a - b) <= 25 for a, b in zip(expected.new_files, reads.new_files))


@pytest.mark.parametrize(
    "shuffle, permuted, entries", [("global", 10_000, 200), ("node", 5_000, 100), ("none", 0, 100)]
)
def test_a_later_epoch_starts_with_its_sample_order_and_the_plan_rewritten(
    shuffle, permuted, entries
):
    """Equation 7: each later epoch's steps begin after the ranks draw the epoch's order and
    local rank 0 rewrites its two-epoch plan; the last epoch has no plan to rewrite, and a
    calibration without the figures charges nothing."""
    reads = equations.NodeReads((100, 60, 60, 60), (10**6,) * 4, np.arange(10, 101, 10), 10,
                                "plan")  # fmt: skip
    shape = JobShape(nodes=2, ranks_per_node=2, batch_size=5, epochs=4, samples=10_000,
                     shuffle=shuffle)  # fmt: skip
    figures = dict(permute_s_per_sample=1e-6, replan_s=0.05, replan_s_per_entry=1e-3)
    charged = replace(CAL, compute=replace(CAL.compute, **figures))
    base = equations.predict_shape(CAL, shape, reads).epoch_s
    more = equations.predict_shape(charged, shape, reads).epoch_s
    draw, plan = 1e-6 * permuted, 0.05 + 1e-3 * entries
    assert more[0] == base[0]  # epoch 1's order and plan come before its first step
    assert more[1:] == pytest.approx([b + draw + plan for b in base[1:3]] + [base[3] + draw])
    assert equations.predict_shape(charged, shape, reads).epoch_start_s == pytest.approx(
        draw + plan
    )


@pytest.mark.parametrize("every, per_epoch", [(0, 1), (4, 3), (5, 2)])
def test_every_epoch_ends_with_the_jobs_checkpoints(every, per_epoch):
    """hpcdl.train writes a checkpoint at every epoch's end with --checkpoint-dir, and every
    --checkpoint-every steps; rank 0 writes it while the others wait at the next collective.
    Each costs the calibration's checkpoint_s in every epoch (10 steps: every 4 -> steps 4, 8
    and the end; every 5 -> 5 and the end, which is step 10); without --checkpoint-dir, or
    without the figure, nothing."""
    reads = equations.NodeReads((100, 60, 60, 60), (10**6,) * 4, np.arange(10, 101, 10), 10,
                                "plan")  # fmt: skip
    plain = JobShape(nodes=2, ranks_per_node=2, batch_size=5, epochs=4)
    saving = replace(plain, checkpoint=True, checkpoint_every=every)
    charged = replace(CAL, compute=replace(CAL.compute, checkpoint_s=0.06))
    base = equations.predict_shape(CAL, plain, reads)
    more = equations.predict_shape(charged, saving, reads)
    assert more.epoch_s == pytest.approx([e + 0.06 * per_epoch for e in base.epoch_s])
    assert more.time_to_last_epoch_s == pytest.approx(base.time_to_last_epoch_s
                                                      + 0.06 * per_epoch * 4)  # fmt: skip
    assert equations.predict_shape(CAL, saving, reads).epoch_s == base.epoch_s
    assert equations.predict_shape(charged, plain, reads).epoch_s == base.epoch_s


def test_dry_run_charges_the_jobs_checkpoints(tree, tmp_path):
    """The dry run takes the training job's --checkpoint-dir and --checkpoint-every (it writes
    nothing there) and adds the calibration's checkpoint_s per checkpoint to every epoch."""
    path = tmp_path / "c.toml"
    calibration.save(path, replace(CAL, compute=replace(CAL.compute, checkpoint_s=0.25)))
    ckpt = tmp_path / "ckpt"

    def epochs(*more: str) -> list[float]:
        proc = stage("--dry-run", "--data", str(tree), "--files-only", "--calibration", str(path),
                     "--nodes", "2", "--ranks-per-node", "2", "--batch-size", "10",
                     "--epochs", "3", "--json", *more)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        (row,) = json.loads(proc.stdout.splitlines()[-1])["predictions"]
        return row["epoch_s"]

    base = epochs()
    assert epochs("--checkpoint-dir", str(ckpt)) == pytest.approx([e + 0.25 for e in base])
    steps = 400 // (2 * 2 * 10)  # 10 steps an epoch: every 3 -> 3, 6, 9 and the end
    assert steps == 10
    assert epochs("--checkpoint-dir", str(ckpt), "--checkpoint-every", "3") == pytest.approx(
        [e + 4 * 0.25 for e in base]
    )
    assert not ckpt.exists()


def test_prediction_totals_sum_every_node_and_the_index():
    reads = equations.NodeReads((100, 40), (10**6, 4 * 10**5), np.arange(10, 101, 10), 10,
                                   "plan")  # fmt: skip
    other = replace(reads, new_files=(90, 30), new_bytes=(9 * 10**5, 3 * 10**5))
    shape = JobShape(nodes=2, ranks_per_node=2, batch_size=5, epochs=2, index_files=300)
    p = equations.predict_shape(CAL, shape, reads, [reads, other])
    assert p.pfs_opens_per_epoch == [490, 70] and p.pfs_opens_total == 560
    assert p.pfs_metadata_ops_per_epoch == [980, 140]
    assert p.images_per_s == pytest.approx(4 * 5 / p.step_s)
    assert p.efficiency == pytest.approx(p.compute_s / p.step_s)
    assert p.time_to_last_epoch_s == pytest.approx(p.index_s + p.epoch1_s + p.later_epoch_s)
    assert math.isclose(p.index_s, 300 * 0.01 / 32)


def test_calibration_file_round_trips_and_names_a_bad_field(tmp_path):
    path = tmp_path / "c.toml"
    calibration.save(path, CAL)
    assert calibration.load(path) == CAL
    path.write_text(path.read_text().replace("v0 = 800.0", 'v0 = "fast"'))
    with pytest.raises(CalibrationError, match=r"c.toml: \[compute\]: v0 must be a number"):
        calibration.load(path)
    path.write_text(CAL.to_toml().replace("node_bandwidth_Bps", "node_bandwith_Bps"))
    with pytest.raises(CalibrationError, match=r"\[pfs\]: unknown field node_bandwith_Bps"):
        calibration.load(path)
    path.write_text(CAL.to_toml().replace('algorithm = "hierarchical"', 'algorithm = "star"'))
    with pytest.raises(CalibrationError, match="algorithm must be one of hierarchical, ring"):
        calibration.load(path)


def stage(*args: str) -> subprocess.CompletedProcess:
    return stage_cli(*args, cwd=REPO)


def test_dry_run_with_a_calibration_predicts_per_node_count(tree, tmp_path):
    path = tmp_path / "c.toml"
    calibration.save(path, CAL)
    proc = stage("--dry-run", "--data", str(tree), "--files-only", "--calibration", str(path),
                 "--nodes", "1,2,4", "--ranks-per-node", "2", "--batch-size", "10",
                 "--epochs", "2", "--json")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout.splitlines()[-1])["predictions"]
    assert [r["nodes"] for r in rows] == [1, 2, 4]
    assert [r["node_files_epoch1"] for r in rows] == [400, 200, 100]
    assert rows[0]["pfs_opens_total"] == 400  # one node reads every file once, then has it
    # with the peer tier (auto: 2+ nodes, global shuffle) a new file comes from the PFS or a peer
    assert [sum(map(sum, r["every_node_new_files"])) for r in rows[1:]] == [
        r["pfs_opens_total"] + sum(r["peer_files_per_epoch"]) for r in rows[1:]
    ]
    assert all(r["reads_source"] == "plan" for r in rows)
    assert "files/node e1" in proc.stdout and "images/s" in proc.stdout


def test_predict_takes_one_typed_request_not_a_namespace(tree):
    from hpcdl.clustermodel.prediction import PredictionRequest, predict  # noqa: PLC0415

    request = PredictionRequest(
        calibration=CAL, source="test", dataset=FileTreeDataset(tree), node_counts=(1, 2, 4),
        ranks_per_node=2, batch_size=10, epochs=2, stage_threads=8, seed=0,
        shuffle="global", placement="block",
    )  # fmt: skip
    rows = predict(request)
    assert [p.nodes for p in rows] == [1, 2, 4]
    assert [p.node_files_epoch1 for p in rows] == [400, 200, 100]
    assert all(p.reads_source == "plan" for p in rows)


def test_projection_without_files_takes_reads_analytically(tmp_path):
    proc = stage("--dry-run", "--calibration", "docs/calibrations/imagenet-lustre-a100.toml",
                 "--dataset-files", "1281167", "--dataset-bytes", "140e9", "--nodes", "8,1024",
                 "--ranks-per-node", "8", "--epochs", "90", "--json")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout.splitlines()[-1])["predictions"]
    assert [r["reads_source"] for r in rows] == ["analytic", "analytic"]
    assert rows[0]["pfs_opens_per_epoch"][0] == 1281167 + 8 * rows[0]["node_files_epoch1"]


def test_a_node_list_without_a_calibration_is_one_clear_line(tree):
    proc = stage("--dry-run", "--data", str(tree), "--nodes", "2,4")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "hpcdl.stage: error: --nodes takes a list (2,4,8) only with --dry-run --calibration"
    ]


def test_bench_calibrate_writes_a_file_the_dry_run_reads(tree, tmp_path):
    out = tmp_path / "calib.toml"
    cmd = [sys.executable, "-m", "hpcdl.bench", "calibrate", "--data", str(tree), "--stage-dir",
           str(tmp_path), "--threads", "2", "--files", "8", "--local-mb", "4", "--steps", "3",
           "--batch-size", "4", "--input-shape", "3,8,8", "--out", str(out), "--json"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cal = calibration.load(out)
    assert cal.pfs.open_latency_s > 0 and cal.pfs.thread_bandwidth_Bps > 0
    assert cal.local.write_bandwidth_Bps > 0 and cal.compute.v0 > 0
    assert cal.peer is not None and cal.peer.fetch_latency_s > 0  # two stagers, one host
    assert cal.peer.thread_bandwidth_Bps > 0
    assert cal.compute.gradient_bytes == 4 * (3 * 8 * 8 * 512 + 512 + 512 * 10 + 10)  # the mlp
    assert cal.compute.permute_s_per_sample > 0 and cal.compute.replan_s_per_entry > 0
    assert "epoch start: " in proc.stdout and " entries: " in proc.stdout, proc.stdout
    assert (
        json.loads(proc.stdout.splitlines()[-1])["compute"]
        == calibration.load(out).to_json()["compute"]
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib.toml"]  # its temp file is gone
    empty = tmp_path / "empty"
    empty.mkdir()
    cmd[cmd.index(str(tree))] = str(empty)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2
    assert f"--data {empty} holds no files to read" in proc.stderr


def test_bench_calibrate_creates_a_missing_stage_dir_as_training_does(tree, tmp_path):
    """A stage dir that does not exist yet is made (hpcdl.train makes it), used and removed;
    one that cannot be a directory is one line, not a traceback."""

    def calibrate(stage_dir: Path) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "hpcdl.bench", "calibrate", "--data", str(tree),
               "--stage-dir", str(stage_dir), "--threads", "1", "--files", "2",
               "--local-mb", "1", "--steps", "1", "--batch-size", "2", "--input-shape", "1,4,4",
               "--repeats", "1"]  # fmt: skip
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)

    missing = tmp_path / "local" / "stage"
    proc = calibrate(missing)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "local disk:" in proc.stdout, proc.stdout
    assert not missing.exists() and not (tmp_path / "local").exists()  # made here, removed
    a_file = tmp_path / "a-file"
    a_file.write_text("mine")
    proc = calibrate(a_file)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and f"cannot use --stage-dir {a_file}" in lines[0], proc.stderr
    assert a_file.read_text() == "mine"


def test_alpha_beta_come_back_from_ring_timings():
    from hpcdl.bench.calibrate import SIZES, fit_alpha_beta

    alpha, beta = 2e-5, 1 / 3e7
    seconds = [equations.ring_s(4, n, alpha, beta) for n in SIZES]
    fitted = fit_alpha_beta(4, SIZES, seconds)
    assert fitted[1] == pytest.approx(beta)
    assert fitted[0] == pytest.approx(alpha + SIZES[0] * beta * 1.5 / 6)  # 4 KiB: some bandwidth
    noisy = list(seconds)
    noisy[-1] = noisy[2] * 0.9  # the largest message measured faster than 1 MiB
    assert fit_alpha_beta(4, SIZES, noisy)[1] == pytest.approx(noisy[-1] / SIZES[-1] / 1.5)
    assert fit_alpha_beta(1, SIZES, seconds) == (0.0, 0.0)


def test_the_algorithm_factor_is_fitted_to_the_trainers_measured_step():
    from types import SimpleNamespace

    from hpcdl.bench.calibrate import fit_to_trainer_step

    world = SimpleNamespace(num_nodes=4, node_comm=SimpleNamespace(size=2))
    args = SimpleNamespace(batch_size=8, bucket_mb=25.0)
    shape = JobShape(4, 2, 8, 1)

    def step_at(factor: float) -> float:
        network = replace(CAL.network, algorithm_factor=factor)
        return equations.step_time(replace(CAL, network=network), shape).step_s

    measured = step_at(1.7)
    assert measured > step_at(1.0)  # the exposed allreduce grows with the factor
    fitted = fit_to_trainer_step(CAL, world, args, measured)
    assert fitted.network.algorithm_factor == pytest.approx(1.7, rel=1e-6)
    assert equations.step_time(fitted, shape).step_s == pytest.approx(measured, rel=1e-9)
    assert fitted.pfs == CAL.pfs and fitted.compute == CAL.compute
    # nothing to fit: a step no longer than compute, or one node (no inter-node formula)
    assert fit_to_trainer_step(CAL, world, args, CAL.compute.step_s(8) / 2) == CAL
    one = SimpleNamespace(num_nodes=1, node_comm=SimpleNamespace(size=2))
    assert fit_to_trainer_step(CAL, one, args, measured) == CAL
