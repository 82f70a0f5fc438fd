"""Rendered sbatch scripts under a real Slurm (slurmctld + slurmd + munged on this host).

The `slurm` fixture (conftest.py) starts a private single-node cluster once per session
(tests/slurm_cluster.py) and tears it down even when tests fail. Jobs train a small MLP on the
digits data set on CPU with 2 ranks. Missing Slurm binaries FAIL these tests (CI must not pass
by silently skipping them); HPCDL_NO_SLURM=1 skips them on machines that cannot run Slurm.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from helpers import run_train
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

from hpcdl import checkpoint

pytestmark = pytest.mark.slurm


def test_train_job_completes_with_two_ranks_and_staging(slurm: SlurmCluster, digits_dir, tmp_path):
    config = write_config(
        tmp_path / "job.toml", digits_dir, epochs=2, metrics=str(tmp_path / "metrics.jsonl")
    )
    script = render(tmp_path, "train", config)
    local = tmp_path / "node-local"
    job = slurm.sbatch(script, env={"HPCDL_STAGE_DIR": str(local)}, cwd=tmp_path)
    info = slurm.wait_done(job, JOB_TIMEOUT)
    assert_state(info, "COMPLETED", "0:0")

    result = summary(tmp_path / "metrics.jsonl")
    assert result["world_size"] == 2
    assert result["stopped_by_signal"] is False
    assert result["staging"] is not None and result["staging"]["files_staged"] > 0, result
    log = log_of(info)
    assert Path(info["StdOut"]).name == f"hpcdl-train-{job}.out"
    assert f"stage dir {local}/hpcdl-u{os.getuid()}" in log
    assert "hpcdl: summary {" in log
    assert f"hpcdl: job {job} finished training" in log


def test_failed_run_gives_failed_job_state(slurm: SlurmCluster, digits_dir, tmp_path):
    config = write_config(tmp_path / "job.toml", digits_dir, data=str(tmp_path / "missing"))
    script = render(tmp_path, "train", config, "--no-stage", name="broken")
    info = slurm.wait_done(slurm.sbatch(script, cwd=tmp_path), JOB_TIMEOUT)
    assert_state(info, "FAILED")
    assert info["ExitCode"] != "0:0"
    log = log_of(info)
    assert "missing" in log  # the trainer's error names the bad path
    assert "FAILED: launcher exit status" in log


def test_signal_stop_checkpoints_and_resubmission_resumes(
    slurm: SlurmCluster, digits_dir, tmp_path
):
    ckpt = tmp_path / "ckpt"
    config = write_config(
        tmp_path / "job.toml",
        digits_dir,
        # The CNN (10-500 ms a step here, idle to loaded) keeps running until the signal lands;
        # max_steps bounds both runs together.
        model="cnn",
        epochs=3,
        max_steps=60,
        checkpoint_dir=str(ckpt),
        metrics_every=1,
    )
    script = render(tmp_path, "train", config, "--no-stage", name="resumable")
    first = slurm.sbatch(script, cwd=tmp_path)
    metrics = tmp_path / f"resumable-{first}.metrics.jsonl"
    wait_for_training_steps(slurm, first, metrics)
    slurm.scancel(first, "--signal=USR1", "--batch")  # what --signal=B:USR1@N does at the limit
    info = slurm.wait_done(first, JOB_TIMEOUT)
    assert_state(info, "FAILED", "3:0")
    log = log_of(info)
    assert "stopped by signal SIGUSR1, checkpoint at" in log
    assert f"job {first} STOPPED by a signal" in log
    stopped = summary(metrics)
    assert stopped["stopped_by_signal"] is True and stopped["checkpoint"], stopped
    assert Path(stopped["checkpoint"]).exists()

    second = slurm.sbatch(script, cwd=tmp_path)  # the same script, resubmitted
    info = slurm.wait_done(second, JOB_TIMEOUT)
    assert_state(info, "COMPLETED", "0:0")
    assert "hpcdl: resumed at epoch" in log_of(info)
    done = summary(tmp_path / f"resumable-{second}.metrics.jsonl")
    assert done["stopped_by_signal"] is False
    assert stopped["steps"] < done["steps"] == 60
    assert done["world_size"] == 2


def test_stage_job_then_dependent_train_job(slurm: SlurmCluster, digits_dir, tmp_path):
    config = write_config(
        tmp_path / "job.toml", digits_dir, metrics=str(tmp_path / "metrics.jsonl")
    )
    stage_script = render(tmp_path, "stage", config, "--stage-key", "chain")
    train_script = render(tmp_path, "train", config, "--stage-key", "chain")
    env = {"HPCDL_STAGE_DIR": str(tmp_path / "node-local")}
    stage = slurm.sbatch(stage_script, env=env, cwd=tmp_path)
    train = slurm.sbatch(train_script, f"--dependency=afterok:{stage}", env=env, cwd=tmp_path)

    stage_info = slurm.wait_done(stage, JOB_TIMEOUT)
    assert_state(stage_info, "COMPLETED", "0:0")
    assert "finished staging into" in log_of(stage_info)
    assert slurm.job(train)["JobState"] in ("PENDING", "RUNNING", "COMPLETED")
    train_info = slurm.wait_done(train, JOB_TIMEOUT)
    assert_state(train_info, "COMPLETED", "0:0")
    assert train_info["StartTime"] >= stage_info["EndTime"]
    assert f"stage dir {tmp_path / 'node-local'}/hpcdl-chain" in log_of(train_info)
    result = summary(tmp_path / "metrics.jsonl")
    assert result["world_size"] == 2 and result["staging"] is not None


def test_a_chain_of_three_jobs_resumes_until_done_and_ends_as_one_run_would(
    slurm: SlurmCluster, digits_dir, tmp_path
):
    ckpt = tmp_path / "ckpt"
    config = write_config(
        tmp_path / "chain.toml",
        digits_dir,
        model=f"{Path(__file__).parent / 'probe_model.py'}:probe_mlp",
        epochs=2,
        checkpoint_dir=str(ckpt),
    )
    # The shortest limit Slurm has (1 minute), the signal 5 s before it. Slurm checks limits
    # every 30 s and sends the signal up to 30 s early, so the first job (2 s a step: 88 s of
    # training) is always cut by it; the probe slows only a job that found no checkpoint.
    render(tmp_path, "train", config, "--time", "00:01:00", "--signal-seconds", "5",
           "--chain", "3", name="chain")  # fmt: skip
    env = {**slurm.env, "HPCDL_STAGE_DIR": str(tmp_path / "node-local")}
    env["HPCDL_PROBE_SLOW"] = f"2:{ckpt}"
    submitted = subprocess.run(["bash", str(tmp_path / "chain.sbatch")], env=env, cwd=tmp_path,
                               capture_output=True, text=True, timeout=60)  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    jobs = [int(line.rsplit(": ", 1)[1]) for line in submitted.stdout.splitlines()]
    assert len(jobs) == 3, submitted.stdout
    assert slurm.job(jobs[2])["Dependency"] == f"afterany:{jobs[1]}(unfulfilled)"

    reference = tmp_path / "reference"  # one uninterrupted run, meanwhile
    proc = run_train(2, "--config", config, "--checkpoint-dir", reference, "--quiet")
    assert proc.returncode == 0, proc.stderr[-3000:]

    first = slurm.wait_done(jobs[0], JOB_TIMEOUT)
    assert_state(first, "FAILED", "3:0")  # stopped by the signal, before the limit's kill
    log = log_of(first)
    assert "batch shell got SIGUSR1" in log and "stopped by signal SIGUSR1, checkpoint at" in log
    second = slurm.wait_done(jobs[1], JOB_TIMEOUT)
    assert_state(second, "COMPLETED", "0:0")
    assert "hpcdl: resumed at epoch" in log_of(second) and "hpcdl.train: final" in log_of(second)
    third = slurm.wait_done(jobs[2], JOB_TIMEOUT)
    assert_state(third, "COMPLETED", "0:0")
    assert "hpcdl.train: nothing to train: checkpoint" in log_of(third)
    assert third["StartTime"] >= second["EndTime"] >= second["StartTime"] >= first["EndTime"]

    done = checkpoint.load(checkpoint.latest(ckpt))
    expected = checkpoint.load(checkpoint.latest(reference))
    assert done.global_step == expected.global_step
    assert done.params.tobytes() == expected.params.tobytes()
