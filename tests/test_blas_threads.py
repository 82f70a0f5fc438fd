"""BLAS threads per rank (issue 12): chosen from the rank's CPU mask, its node's ranks, Slurm's
cpus-per-task and the user's environment; set for real and said once."""

from __future__ import annotations

import os
import re

import pytest
from helpers import mpi_env, read_events, run_train

from hpcdl.comm.blas_threads import apply, choose

NODE = frozenset(range(8))


def test_ranks_sharing_one_mask_split_its_cores():
    choice = choose(NODE, [NODE] * 4, {})
    assert choice.threads == 2
    assert choice.reason == "8 core(s) shared by 4 ranks"


def test_a_rank_bound_to_its_own_cores_uses_them_all():
    masks = [frozenset({0, 1, 2}), frozenset({3, 4, 5}), frozenset({6, 7})]
    assert choose(masks[0], masks, {}).threads == 3
    assert choose(masks[2], masks, {}).reason == "2 core(s) bound to this rank"


def test_more_ranks_than_cores_still_get_one_thread():
    assert choose(frozenset({0, 1}), [frozenset({0, 1})] * 5, {}).threads == 1


def test_slurm_cpus_per_task_caps_the_share():
    choice = choose(NODE, [NODE, NODE], {"SLURM_CPUS_PER_TASK": "3"})
    assert choice.threads == 3 and choice.reason.startswith("SLURM_CPUS_PER_TASK=3, ")
    assert choose(NODE, [NODE, NODE], {"SLURM_CPUS_PER_TASK": "16"}).threads == 4


@pytest.mark.parametrize("var", ["OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"])
def test_the_users_thread_variable_wins_but_never_above_the_ranks_cores(var):
    assert choose(NODE, [NODE] * 4, {var: "5"}).threads == 5
    capped = choose(frozenset({0, 1}), [frozenset({0, 1})], {var: "64"})
    assert capped.threads == 2
    assert capped.reason == f"{var}=64 from the environment, capped at the 2 core(s) of its mask"


def test_the_limit_is_set_in_the_blas_numpy_uses():
    pool = apply(1)
    if pool.library == "none":
        pytest.skip("this NumPy has no threaded BLAS to limit")
    assert pool.threads == 1


def _blas_line(stdout: str) -> str:
    lines = [line for line in stdout.splitlines() if "; BLAS " in line]
    assert len(lines) == 1, stdout
    return lines[0]


def test_training_sets_and_reports_the_threads_of_every_rank_once(digits_dir, tmp_path):
    metrics = tmp_path / "m.jsonl"
    args = ["--data", digits_dir / "train", "--epochs", 1, "--max-steps", 2, "--workers", 0]
    env = {
        k: v
        for k, v in mpi_env().items()
        if k
        not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "SLURM_CPUS_PER_TASK")
    }
    proc = run_train(2, *args, "--metrics", metrics, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    threads = read_events(metrics, "start")[0]["cpu_threads"]
    cores = len(os.sched_getaffinity(0))
    assert len(threads) == 2 and all(t >= 1 for t in threads), threads
    assert sum(threads) <= max(cores, 2), (threads, cores)  # the two ranks never oversubscribe
    line = _blas_line(proc.stdout)
    assert re.fullmatch(
        r"hpcdl: \d.* per rank \(.*core\(s\).*\); BLAS \S.* on 1 thread\(s\).*", line
    )
    if max(threads) > 1:  # a rank with several cores splits its convolutions over them
        assert line.endswith(", convolutions split over them by images"), line


def test_omp_num_threads_from_the_job_is_honoured(digits_dir, tmp_path):
    metrics = tmp_path / "m.jsonl"
    args = ["--data", digits_dir / "train", "--epochs", 1, "--max-steps", 2, "--workers", 0]
    env = {**mpi_env(), "OMP_NUM_THREADS": "1"}
    proc = run_train(2, *args, "--metrics", metrics, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert read_events(metrics, "start")[0]["cpu_threads"] == [1, 1]
    line = _blas_line(proc.stdout)
    assert line.startswith("hpcdl: 1 thread(s) per rank (OMP_NUM_THREADS=1 from the environment); ")
    assert line.endswith(" on 1 thread(s)"), line


def test_omp_num_threads_above_one_splits_the_convolutions(digits_dir, tmp_path):
    metrics = tmp_path / "m.jsonl"
    args = ["--data", digits_dir / "train", "--model", "cnn", "--epochs", 1, "--max-steps", 2]
    env = {**mpi_env(), "OMP_NUM_THREADS": "2"}
    proc = run_train(1, *args, "--workers", 0, "--metrics", metrics, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cores = len(os.sched_getaffinity(0))
    assert read_events(metrics, "start")[0]["cpu_threads"] == [min(2, cores)]
    if cores >= 2:
        assert _blas_line(proc.stdout).endswith(
            "on 1 thread(s), convolutions split over them by images"
        ), proc.stdout
