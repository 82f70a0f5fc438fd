"""examples/horovod_resnet.py under mpirun on 2 ranks (CPU): a Horovod-style script with
`import hpcdl.torch as hvd` and hpcdl.torch.Loader staging to a node-local directory trains,
every rank ends with the same parameters, the loss falls, and the staged copies are gone after.
Real Open MPI, hpcdl-stage and files; a hang fails through the timeout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import mpi_env, mpirun_cmd

pytest.importorskip("torch")
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "horovod_resnet.py"
TINY = ["--blocks", 1, "--width", 4, "--batch-size", 16, "--workers", 1, "--lr", 0.05]


def run(data: Path, *flags) -> dict:
    cmd = [*mpirun_cmd(2), sys.executable, EXAMPLE, "--data", data, *TINY, *flags]
    done = subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, env=mpi_env(), timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_trains_with_staging_and_every_rank_agrees(digits_dir, tmp_path):
    stage = tmp_path / "stage"
    out = run(digits_dir / "train", "--epochs", 3, "--stage-dir", stage)
    assert out["ranks"] == 2 and out["ranks_agree"]
    assert out["losses"][-1] < out["losses"][0]
    assert out["stats"]["staging"] and out["stats"]["files_staged"] > 0
    assert not stage.exists() or not any(stage.rglob("*.h5"))


def test_sync_batch_norm_and_fp16_compression_run_the_same_script(digits_dir):
    out = run(digits_dir / "train", "--epochs", 1, "--sync-bn", "--fp16-allreduce")
    assert out["ranks_agree"] and out["losses"][0] > 0
