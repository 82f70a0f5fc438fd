"""`python -m hpcdl.bench torch-sync` end to end, tiny: every mode runs under mpirun (2 ranks)
and is reported with images/s, exposed communication and its ratio to DDP; a bad model name is
one line. The figures themselves are measured in docs/PERFORMANCE.md, not asserted here."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch")


def bench(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "hpcdl.bench", "torch-sync", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_every_mode_is_measured_and_compared_with_ddp():
    done = bench(
        "--models",
        "resnet20",
        "--batch-size",
        "2",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--rounds",
        "1",
        "--fp16",
        "--json",
    )
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert [r["mode"] for r in rows] == ["local", "ddp", "hvd", "hvd-fp16"]
    for r in rows:
        assert r["images_per_s"] > 0 and r["step_ms"] > 0
        assert r["vs_ddp"] == pytest.approx(r["images_per_s"] / rows[1]["images_per_s"])
    assert rows[0]["exposed_comm_ms"] == 0
    assert "resnet20  hvd-fp16" in done.stdout


def test_an_unknown_model_is_one_line():
    done = bench("--models", "vgg")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().count("\n") == 0 and "--models vgg" in done.stderr


@pytest.mark.multinode
def test_the_same_modes_across_two_emulated_nodes_behind_a_1gbit_link():
    from tools.bench.cluster import unavailable

    reason = unavailable()
    if reason:
        pytest.skip(reason)
    cmd = [sys.executable, "-m", "tools.bench", "torch-sync-nodes", "--models", "resnet20"]
    cmd += ["--batch-size", "2", "--steps", "2", "--warmup", "1", "--rounds", "1", "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "2 emulated nodes x 1 ranks, links 1gbit" in done.stdout
    rows = json.loads(done.stdout.strip().splitlines()[-2])
    assert [r["mode"] for r in rows] == ["local", "ddp", "hvd"]
    assert all(r["images_per_s"] > 0 for r in rows)
