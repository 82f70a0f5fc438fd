"""`python -m hpcdl.stage`: version, dry run vs stage-only, capacity-limited runs, TOML config."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from test_staging_helpers import make_tree


def stage(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "hpcdl.stage", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_version_runs_the_binary():
    out = stage("--version")
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
    dry = stage("--dry-run", *common, "--epochs", 3, "--write-plans", tmp_path / "plans", "--json")
    assert dry.returncode == 0, dry.stderr
    nodes = json.loads(dry.stdout.splitlines()[-1])["nodes"]
    assert [n["node"] for n in nodes] == [0, 1, 2] and all(n["fits"] for n in nodes)
    assert len(list((tmp_path / "plans").iterdir())) == 3
    for node in (0, 2):
        out = stage(*common, "--node", node, "--stage-dir", tmp_path / f"s{node}", "--json")
        assert out.returncode == 0, out.stderr
        summary = json.loads(out.stdout.splitlines()[-1])
        assert summary["copied"] == nodes[node]["files"] and summary["failures"] == 0
        assert summary["bytes"] == nodes[node]["bytes"]
        assert "100%" in out.stderr
    again = stage(*common, "--node", 0, "--stage-dir", tmp_path / "s0", "--json")
    summary = json.loads(again.stdout.splitlines()[-1])
    assert summary["copied"] == 0 and summary["reused"] == nodes[0]["files"]


def test_capacity_limit_stops_growing_with_a_clear_summary(tmp_path):
    ds = make_tree(tmp_path / "data", 40, 1000)
    toml = tmp_path / "job.toml"
    toml.write_text(
        f'data = "{ds.root}"\nfiles_only = true\nbatch_size = 2\nstage_capacity = "10000"\n'
    )
    out = stage("--config", toml, "--stage-dir", tmp_path / "s", "--json")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.splitlines()[-1])
    assert summary["capacity_full"] and 0 < summary["bytes"] <= 10_000
    assert "capacity reached" in out.stdout


def test_bad_flag_value_is_one_clear_error(tmp_path):
    out = stage("--dry-run", "--data", tmp_path / "missing", "--files-only")
    assert out.returncode == 2 and "missing" in out.stderr and "Traceback" not in out.stderr


def test_a_failing_leader_under_mpirun_ends_the_stage_job_quickly(tmp_path):
    from conftest import mpi_env, mpirun_cmd

    ds = make_tree(tmp_path / "data", 8, 100)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a regular file where the stage dir should be\n")
    start = time.monotonic()
    proc = subprocess.run(
        [*mpirun_cmd(2), sys.executable, "-m", "hpcdl.stage"]
        + ["--data", str(ds.root), "--files-only", "--stage-dir", str(blocker)],
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
