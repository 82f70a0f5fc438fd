"""How a rendered training job ends when it is cancelled or its trainer writes elsewhere, under
the real test Slurm (the `slurm` fixture, conftest.py; docs/slurm.md, "Reading the logs")."""

from __future__ import annotations

from pathlib import Path

import pytest
from slurm_cluster import SlurmCluster
from slurm_jobs import (
    JOB_TIMEOUT,
    assert_state,
    log_of,
    render,
    summary,
    wait_for_training_steps,
    write_config,
)

pytestmark = pytest.mark.slurm


def test_plain_scancel_stops_with_a_checkpoint_and_exit_3(
    slurm: SlurmCluster, digits_dir, tmp_path
):
    ckpt = tmp_path / "ckpt"
    config = write_config(tmp_path / "job.toml", digits_dir, model="cnn", epochs=50,
                          checkpoint_dir=str(ckpt), metrics_every=1)  # fmt: skip
    script = render(tmp_path, "train", config, "--no-stage", name="cancelled")
    job = slurm.sbatch(script, cwd=tmp_path)
    metrics = tmp_path / f"cancelled-{job}.metrics.jsonl"
    wait_for_training_steps(slurm, job, metrics)
    slurm.scancel(job)  # SIGCONT + SIGTERM to every process of the job, SIGKILL after KillWait
    info = slurm.wait_done(job, JOB_TIMEOUT)
    assert_state(info, "CANCELLED", "3:0")
    log = log_of(info)
    assert "stopped by signal" in log and "checkpoint at" in log, log[-3000:]
    assert f"hpcdl: job {job} STOPPED by a signal" in log, log[-3000:]
    assert "FAILED" not in log and "see the errors above" not in log, log[-3000:]
    stopped = summary(metrics)
    assert stopped["stopped_by_signal"] is True and Path(stopped["checkpoint"]).exists()
    assert not [p.name for p in ckpt.iterdir() if p.name.endswith(".tmp")]


def test_metrics_given_after_a_bare_dashdash_is_where_the_job_looks_for_its_summary(
    slurm: SlurmCluster, digits_dir, tmp_path
):
    config = write_config(tmp_path / "job.toml", digits_dir)
    other = tmp_path / "other.jsonl"
    script = render(tmp_path, "train", config, "--no-stage", "--", "--metrics", str(other),
                    name="elsewhere")  # fmt: skip
    info = slurm.wait_done(slurm.sbatch(script, cwd=tmp_path), JOB_TIMEOUT)
    assert_state(info, "COMPLETED", "0:0")
    assert f"hpcdl: job {info['JobId']} finished training" in log_of(info)
    assert summary(other)["stopped_by_signal"] is False
