"""Where a rank's loader workers and its node's stager run (hpcdl.data.worker_cores, NOTE
[worker cores]): mpirun binds a rank to one core when it starts two ranks or fewer, and the
workers inherited that one core while the node's others idled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from helpers import job_pids, make_tree, mpi_env, mpirun_cmd, wait_until

from hpcdl.data import Loader, open_dataset
from hpcdl.data.worker_cores import (
    ENV,
    WorkerCores,
    cpu_list,
    job_cores,
    parse_cpu_list,
    plan,
    spawning_on,
    whole_node,
)

EIGHT = frozenset(range(8))
HERE = frozenset(os.sched_getaffinity(0))
two_cores = pytest.mark.skipif(len(HERE) < 2, reason="needs 2 CPUs to show workers spreading")


def one(*cpus: int) -> frozenset[int]:
    return frozenset(cpus)


def test_ranks_that_are_not_bound_change_nothing():
    placed = plan(EIGHT, [EIGHT, EIGHT], 1, EIGHT, env={})
    assert placed.cores == EIGHT and placed.extra == frozenset()
    assert (placed.count, placed.default_workers) == (4, 3)  # 8 cores, 2 ranks, one each kept
    assert placed.describe() == ""


def test_ranks_bound_to_a_core_each_split_the_free_cores():
    masks = [one(0), one(1)]
    first, second = (plan(masks[r], masks, r, EIGHT, env={}) for r in (0, 1))
    assert first.cores == one(0, 2, 3, 4) and second.cores == one(1, 5, 6, 7)
    assert first.extra | second.extra == EIGHT - one(0, 1)
    assert (first.count, first.default_workers) == (4, 3)
    assert first.bound == one(0)
    assert first.describe().startswith(
        "workers on cores 0,2-4: the rank is bound to 0, 3 core(s) no rank is bound to added"
    )


def test_a_remainder_of_free_cores_goes_to_the_first_ranks():
    masks = [one(0), one(1), one(2)]
    job = frozenset(range(10))  # 7 free: 3, 2, 2
    extras = [plan(masks[r], masks, r, job, env={}).extra for r in range(3)]
    assert extras == [one(3, 4, 5), one(6, 7), one(8, 9)]


def test_ranks_bound_to_a_package_count_the_ranks_that_share_it():
    """mpirun -np 4 on two 8-core packages: two ranks per package, nothing free. The old
    default (the rank's cores / the node's ranks - 1) gave 1 worker; the package's share is 4."""
    low, high = frozenset(range(8)), frozenset(range(8, 16))
    masks = [low, low, high, high]
    placed = plan(high, masks, 3, low | high, env={})
    assert placed.cores == high and placed.extra == frozenset()
    assert (placed.count, placed.default_workers) == (4, 3)


def test_masks_that_cover_the_job_are_left_as_they_are():
    """srun --cpus-per-task=4: each rank already has its cores."""
    masks = [frozenset(range(4)), frozenset(range(4, 8))]
    placed = plan(masks[1], masks, 1, EIGHT, env={})
    assert placed.cores == masks[1] and placed.describe() == ""
    assert placed.default_workers == 3


def test_inherit_keeps_the_workers_on_the_rank_mask():
    masks = [one(0), one(1)]
    placed = plan(one(0), masks, 0, EIGHT, env={ENV: "inherit"})
    assert placed.cores == one(0) and placed.extra == frozenset()
    assert placed.default_workers == 1


def test_kernel_cpu_lists():
    assert parse_cpu_list("0-3,8,10-11\n") == frozenset({0, 1, 2, 3, 8, 10, 11})
    assert parse_cpu_list("") == frozenset()
    assert cpu_list(frozenset({0, 1, 2, 3, 8, 10, 11})) == "0-3,8,10-11"
    assert cpu_list(frozenset({5})) == "5"
    with pytest.raises(ValueError):
        parse_cpu_list("zero")


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_the_job_cores_are_the_nearest_cgroup_cpuset(tmp_path):
    online = write(tmp_path / "online", "0-15\n")
    root = tmp_path / "cgroup"
    # cgroup v2: the step's own cgroup has no cpuset file, its job's has
    write(root / "job_7" / "cpuset.cpus.effective", "4-7,12\n")
    (root / "job_7" / "step_0").mkdir()
    v2 = write(tmp_path / "v2", "0::/job_7/step_0\n")
    assert job_cores(root, v2, online) == frozenset({4, 5, 6, 7, 12})
    # cgroup v1: the cpuset hierarchy of its own
    write(root / "cpuset" / "slurm" / "job_8" / "cpuset.effective_cpus", "2-3\n")
    v1 = write(tmp_path / "v1", "not a cgroup line\n4:memory:/slurm/job_8\n3:cpuset:/slurm/job_8\n")
    assert job_cores(root, v1, online) == frozenset({2, 3})
    # no cpuset anywhere: every online CPU
    none = write(tmp_path / "none", "4:memory:/x\n")
    assert job_cores(root, none, online) == frozenset(range(16))
    # a cpuset naming CPUs that are not online counts only the online ones
    write(root / "wide" / "cpuset.cpus.effective", "8-31\n")
    wide = write(tmp_path / "wide-v2", "0::/wide\n")
    assert job_cores(root, wide, online) == frozenset(range(8, 16))


def test_the_job_cores_here_hold_this_process_cores():
    assert HERE <= job_cores()


CHILD_MASK = "import json, os; print(json.dumps(sorted(os.sched_getaffinity(0))))"


def child_mask() -> list[int]:
    out = subprocess.run([sys.executable, "-c", CHILD_MASK], capture_output=True, text=True)
    return json.loads(out.stdout)


@two_cores
def test_a_child_started_inside_spawning_on_runs_on_its_cores_and_the_thread_keeps_its_own():
    low = one(min(HERE))
    os.sched_setaffinity(0, low)  # as mpirun binds a rank
    try:
        assert child_mask() == sorted(low)  # inherited, as before
        with spawning_on(HERE):
            wide = child_mask()
        assert wide == sorted(HERE)
        assert os.sched_getaffinity(0) == low  # the calling thread is put back
    finally:
        os.sched_setaffinity(0, HERE)
    with spawning_on(low):  # narrowing works the same way
        assert child_mask() == sorted(low)
    with spawning_on(None):
        assert child_mask() == sorted(HERE)


def mask_of(pid: int) -> frozenset[int]:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return parse_cpu_list(line.split(":", 1)[1])
    raise AssertionError(f"no Cpus_allowed_list for {pid}")


@two_cores
def test_the_loader_workers_run_on_the_cores_given(digits_dir):
    ds = open_dataset(digits_dir / "train")
    cores = one(max(HERE))
    placed = WorkerCores(cores, 1, frozenset(), cores)
    with Loader(ds, 16, workers=2, cores=placed) as loader:
        pids = [p.pid for p in loader._pool.procs]
        assert [mask_of(p) for p in pids] == [cores, cores]
        images, _ = next(iter(loader.iterate([list(range(16))], 0)))
        assert images.shape[0] == 16
    assert frozenset(os.sched_getaffinity(0)) == HERE


def job_masks(marker: str) -> dict[str, frozenset[int]]:
    """rank, workers and stager of a marked training job, by role, once all have started."""
    found: dict[str, frozenset[int]] = {}
    for pid in job_pids(marker):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            mask = mask_of(pid)
        except (OSError, AssertionError):
            continue
        if Path(argv[0].decode()).name == "hpcdl-stage":
            role = "stager"
        elif argv[1:3] == [b"-m", b"hpcdl.train"]:
            role = "rank"
        elif argv[1:3] == [b"-m", b"hpcdl.data.worker"]:
            role = "worker"
        else:
            continue  # mpirun, prted
        found[role] = found.get(role, frozenset()) | mask
    return found if len(found) == 3 else {}


def run_bound(digits_dir, tmp_path, extra_env: dict[str, str]):
    """`mpirun -np 1 --bind-to hwthread python -m hpcdl.train` (one CPU, with or without SMT;
    a plain mpirun binds to a core), its processes' masks read while it runs; (masks by role,
    the finished run)."""
    marker = uuid.uuid4().hex
    env = {**mpi_env(), "HPCDL_TEST_MARKER": marker, **extra_env}
    cmd = [*mpirun_cmd(1), "--bind-to", "hwthread", sys.executable, "-m", "hpcdl.train",
           "--data", str(digits_dir / "train"), "--model", "mlp", "--epochs", "30",
           "--batch-size", "16", "--workers", "2", "--stage-dir", str(tmp_path / "stage"),
           "--progress", "none"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip

    def settled() -> dict[str, frozenset[int]]:  # the rank widens a thread while it spawns
        masks = job_masks(marker)
        return masks if masks and len(masks["rank"]) == 1 else {}

    try:
        masks = wait_until(settled, 60, "the job's rank (on one core), workers and stager")
        out, _ = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    return masks, out


@two_cores
def test_mpirun_binding_the_rank_no_longer_confines_its_workers(digits_dir, tmp_path):
    masks, out = run_bound(digits_dir, tmp_path, {})
    assert "(1 core(s) bound to this rank)" in out  # its BLAS threads, chosen after the spawns
    every = job_cores()
    assert masks["worker"] == every and masks["stager"] == every, masks
    assert f"rank 0's workers on cores {cpu_list(every)}: the rank is bound to" in out


@two_cores
def test_inherit_leaves_the_workers_on_the_rank_core(digits_dir, tmp_path):
    masks, out = run_bound(digits_dir, tmp_path, {ENV: "inherit"})
    assert masks["worker"] == masks["rank"] == masks["stager"], masks
    assert "rank 0's workers on cores" not in out


@two_cores
def test_the_doctor_gives_the_rank_and_worker_cores(tmp_path):
    cmd = [*mpirun_cmd(1), "--bind-to", "hwthread", sys.executable, "-m", "hpcdl.doctor",
           "--json", "--stage-dir", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, env=mpi_env(), capture_output=True, text=True, timeout=120)
    loader = json.loads(proc.stdout)["nodes"][0]["facts"]["loader"]
    assert len(parse_cpu_list(loader["rank_cores"])) == 1, loader
    assert parse_cpu_list(loader["worker_cores"]) == job_cores(), loader
    assert loader["workers"] == len(job_cores()) - 1  # the rank keeps one core


@two_cores
def test_stage_only_under_a_bound_mpirun_stages_on_the_job_cores(tmp_path):
    """hpcdl.stage's stager works alone on its node: it gets the job's cores, and a local
    source's copy threads are chosen for them, not for the one core mpirun bound the rank to."""
    make_tree(tmp_path / "data", 12, 100)
    cmd = [*mpirun_cmd(1), "--bind-to", "hwthread", sys.executable, "-m", "hpcdl.stage",
           "--data", str(tmp_path / "data"), "--stage-dir", str(tmp_path / "s"),
           "--files-only", "--batch-size", "4"]  # fmt: skip
    proc = subprocess.run(cmd, env=mpi_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"({len(job_cores())} cores; --stage-threads to choose)" in proc.stderr
    inherited = subprocess.run(cmd, env={**mpi_env(), ENV: "inherit"}, capture_output=True,
                               text=True, timeout=120)  # fmt: skip
    assert "(1 cores; --stage-threads to choose)" in inherited.stderr, inherited.stderr


def test_whole_node_is_none_where_nothing_would_change(monkeypatch):
    monkeypatch.setenv(ENV, "inherit")
    assert whole_node() is None
    monkeypatch.delenv(ENV)
    assert whole_node() in (None, job_cores())
    assert (whole_node() is None) == (job_cores() <= HERE)
