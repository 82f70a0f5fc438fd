"""`python -m hpcdl.stage`: version, dry run vs stage-only, capacity-limited runs, TOML config."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from helpers import make_tree, stage_cli


def test_version_runs_the_binary():
    out = stage_cli("--version")
    assert out.returncode == 0 and out.stdout.startswith("hpcdl-stage ")


def test_dry_run_counts_match_a_stage_only_run_and_rerun_reuses(tmp_path):
    ds = make_tree(tmp_path / "data", 90, 500)
    common = [
        "--data",
        ds.root,
        "--files-only",
        "--nodes",
        3,
        "--ranks-per-node",
        2,
        "--batch-size",
        4,
        "--seed",
        5,
    ]
    plans = tmp_path / "plans"
    dry = stage_cli("--dry-run", *common, "--epochs", 3, "--write-plans", plans, "--json")
    assert dry.returncode == 0, dry.stderr
    nodes = json.loads(dry.stdout.splitlines()[-1])["nodes"]
    assert [n["node"] for n in nodes] == [0, 1, 2] and all(n["fits"] for n in nodes)
    # Per epoch, all nodes: every copy from the PFS, or each file once from the PFS with peers.
    epochs = json.loads(dry.stdout.splitlines()[-1])["epochs"]
    assert [e["epoch"] for e in epochs] == [0, 1, 2]
    assert sum(e["staged_files"] for e in epochs) == sum(n["run_files"] for n in nodes)
    assert all(e["pfs_files"] + e["peer_files"] == e["staged_files"] for e in epochs)
    assert epochs[0]["peer_files"] == 0 and epochs[2]["peer_files"] > 0
    assert sum(e["pfs_files"] for e in epochs) <= 90
    assert "epoch 2: " in dry.stdout
    assert len(list((tmp_path / "plans").iterdir())) == 3
    for node in (0, 2):
        out = stage_cli(*common, "--node", node, "--stage-dir", tmp_path / f"s{node}", "--json")
        assert out.returncode == 0, out.stderr
        summary = json.loads(out.stdout.splitlines()[-1])
        assert summary["copied"] == nodes[node]["files"] and summary["failures"] == 0
        assert summary["bytes"] == nodes[node]["bytes"]
        assert "100%" in out.stderr
    again = stage_cli(*common, "--node", 0, "--stage-dir", tmp_path / "s0", "--json")
    summary = json.loads(again.stdout.splitlines()[-1])
    assert summary["copied"] == 0 and summary["reused"] == nodes[0]["files"]


def test_capacity_limit_stops_growing_with_a_clear_summary(tmp_path):
    ds = make_tree(tmp_path / "data", 40, 1000)
    toml = tmp_path / "job.toml"
    toml.write_text(
        f'data = "{ds.root}"\nfiles_only = true\nbatch_size = 2\nstage_capacity = "10000"\n'
    )
    out = stage_cli("--config", toml, "--stage-dir", tmp_path / "s", "--json")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.splitlines()[-1])
    assert summary["capacity_full"] and 0 < summary["bytes"] <= 10_000
    assert "capacity reached" in out.stdout


def test_bad_flag_value_is_one_clear_error(tmp_path):
    out = stage_cli("--dry-run", "--data", tmp_path / "missing", "--files-only")
    assert out.returncode == 2 and "missing" in out.stderr and "Traceback" not in out.stderr


def test_stage_only_under_mpirun_into_a_file_writes_whole_lines(tmp_path):
    """The live line is drawn only on a terminal. Open MPI gives a rank a pty as stdout but a
    pipe as stderr, where hpcdl.stage reports, so isatty() is honest here (unlike the trainer's
    stdout: tests/test_progress.py); this keeps it so."""
    from helpers import mpi_env, mpirun_cmd  # noqa: PLC0415

    ds = make_tree(tmp_path / "data", 30, 500)
    env = {**mpi_env(), "HPCDL_STAGE_EMULATE_PFS": "latency_ms=40"}
    env.pop("HPCDL_PROGRESS", None)
    log = tmp_path / "stage.log"
    cmd = [*mpirun_cmd(1), sys.executable, "-m", "hpcdl.stage", "--data", str(ds.root)]
    cmd += ["--files-only", "--batch-size", "2", "--stage-dir", str(tmp_path / "s")]
    cmd += ["--stage-threads", "1"]
    with open(log, "w") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=120)
    text = log.read_text()
    assert proc.returncode == 0, text
    assert "\r" not in text, repr(text)
    assert "node 0: 100% (30/30 files)" in text, text


def test_dry_run_shows_the_shape_the_loader_yields_from_the_training_config(tmp_path):
    from helpers import make_folder  # noqa: PLC0415

    make_folder(tmp_path / "data", per_class=2, size=(64, 40))
    config = tmp_path / "job.toml"
    config.write_text('data = "data"\naugment = "rrc32+flip"\nbatch_size = 2\n')
    dry = stage_cli("--dry-run", "--config", config, "--json")
    assert dry.returncode == 0, dry.stderr
    assert json.loads(dry.stdout.splitlines()[-1])["sample_shape"] == [3, 32, 32]
    assert (
        "samples reach the model as (3, 32, 32) (C, H, W) with --augment rrc32+flip" in dry.stdout
    )
    plain = stage_cli("--dry-run", "--data", tmp_path / "data", "--batch-size", 2, "--json")
    assert json.loads(plain.stdout.splitlines()[-1])["sample_shape"] == [3, 40, 64]
    bad = stage_cli("--dry-run", "--data", tmp_path / "data", "--augment", "rrc")
    assert bad.returncode == 2 and "--augment: unknown op 'rrc'" in bad.stderr


def test_a_failing_leader_under_mpirun_ends_the_stage_job_quickly(tmp_path):
    from helpers import mpi_env, mpirun_cmd

    ds = make_tree(tmp_path / "data", 8, 100)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a regular file where the stage dir should be\n")
    start = time.monotonic()
    proc = subprocess.run(
        [*mpirun_cmd(2), sys.executable, "-m", "hpcdl.stage"]
        + ["--data", str(ds.root), "--files-only", "--batch-size", "2"]
        + ["--stage-dir", str(blocker)],
        capture_output=True,
        text=True,
        env=mpi_env(),
        timeout=120,
    )
    assert proc.returncode != 0
    assert time.monotonic() - start < 30, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.count(str(blocker)) == 1, proc.stderr
    assert blocker.read_text() == "a regular file where the stage dir should be\n"
