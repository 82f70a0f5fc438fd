"""What the Slurm job tests share: a job's TOML config, `python -m hpcdl.jobs render` into an
sbatch script, and reading a finished job's state, log and metrics summary."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from slurm_cluster import SlurmCluster

JOB_TIMEOUT = 120.0  # seconds for one small training job on 2 shared cores


def write_config(path: Path, digits: Path, **values) -> Path:
    settings = dict(
        data=str(digits / "train"),
        val_data=str(digits / "val"),
        model="mlp",
        epochs=1,
        batch_size=32,
        workers=0,
        seed=0,
    )
    settings.update(values)
    path.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in settings.items()))
    return path


def render(tmp_path: Path, kind: str, config: Path, *args: str, name: str = "") -> Path:
    """`python -m hpcdl.jobs render` for the generic site into tmp_path/<name>.sbatch;
    args after the defaults (a later --time wins)."""
    name = name or f"hpcdl-{kind}"
    cmd = [
        sys.executable,
        "-m",
        "hpcdl.jobs",
        "render",
        kind,
        "--nodes",
        "1",
        "--tasks-per-node",
        "2",
        "--device",
        "cpu",
        "--time",
        "00:10:00",
        "--config",
        str(config),
        "--output",
        str(tmp_path),
        "--job-name",
        name,
        *args,
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    script = tmp_path / f"{name}.sbatch"
    script.write_text(r.stdout)
    return script


def summary(metrics: Path) -> dict:
    lines = [json.loads(li) for li in metrics.read_text().splitlines() if li.strip()]
    found = [r for r in lines if r.get("event") == "summary"]
    assert found, f"no summary event in {metrics}"
    return found[-1]


def log_of(info: dict) -> str:
    return Path(info["StdOut"]).read_text(errors="replace")


def assert_state(info: dict, state: str, exit_code: str | None = None) -> None:
    detail = f"job {info.get('JobId')}: {info.get('JobState')} {info.get('ExitCode')}\n"
    if info.get("StdOut") and Path(info["StdOut"]).exists():
        detail += log_of(info)[-4000:]
    assert info["JobState"] == state, detail
    if exit_code is not None:
        assert info["ExitCode"] == exit_code, detail


def wait_for_training_steps(slurm: SlurmCluster, job: int, metrics: Path) -> None:
    """Block until rank 0 has logged a training step (so a signal lands mid-training)."""
    deadline = time.monotonic() + JOB_TIMEOUT
    while time.monotonic() < deadline:
        if metrics.exists() and '"event": "step"' in metrics.read_text():
            return
        state = slurm.job(job).get("JobState")
        if state not in ("PENDING", "CONFIGURING", "RUNNING"):
            pytest.fail(
                f"job {job} ended ({state}) before training started:\n"
                + Path(slurm.job(job)["StdOut"]).read_text(errors="replace")
            )
        time.sleep(0.1)
    pytest.fail(f"job {job} logged no training step within {JOB_TIMEOUT:.0f} s")
