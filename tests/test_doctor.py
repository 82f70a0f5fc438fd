"""python -m hpcdl.doctor: real MPI, real stager, real file systems (one via a private mount)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys

import pytest
from helpers import mpi_env, mpirun_cmd

from hpcdl.doctor.findings import ERROR, WARNING, Problem, exit_status, merge, rank_ranges
from hpcdl.doctor.probes import THREAD_LEVELS
from hpcdl.doctor.stagedir import (
    check_stage_dir,
    classify,
    mount_of,
    parse_mounts,
    read_mounts,
)

DOCTOR = [sys.executable, "-m", "hpcdl.doctor"]


def doctor_env(**changes: str | None) -> dict[str, str]:
    """The test environment with one BLAS thread per rank (2 ranks fit any machine)."""
    env = {**mpi_env(), "OMP_NUM_THREADS": "1"}
    for key in ("HPCDL_STAGE_BIN", "HPCDL_CUDA_AWARE", "SLURM_JOB_ID", "HPCDL_STAGE_DIR"):
        env.pop(key, None)
    for key, value in changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def run_doctor(*args, env=None, prefix=(), timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*prefix, *DOCTOR, *map(str, args)],
        capture_output=True,
        text=True,
        env=env or doctor_env(),
        timeout=timeout,
    )


def problem_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith(("error: ", "warning: "))]


def test_json_on_this_machine(tmp_path):
    proc = run_doctor("--json", "--stage-dir", tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert (report["world_size"], report["num_nodes"], report["problems"]) == (1, 1, [])
    facts = report["nodes"][0]["facts"]
    assert facts["mpi"]["library"].startswith("Open MPI v"), facts["mpi"]
    assert facts["mpi"]["thread_level"] in THREAD_LEVELS
    assert facts["cuda_aware"]["aware"] is False, facts["cuda_aware"]
    assert facts["stager"]["version"].startswith("hpcdl-stage "), facts["stager"]
    stage = facts["stage_dir"]
    assert stage["path"] == str(tmp_path) and stage["writable"] is True
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    assert abs(stage["free_bytes"] - free) < 256 << 20, (stage, free)
    assert list(tmp_path.iterdir()) == []  # the probe file is gone


def test_text_report_names_each_check(tmp_path):
    proc = run_doctor("--stage-dir", tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for label in ("MPI", "CUDA-aware", "GPUs", "BLAS", "stager", "stage dir", "Slurm"):
        assert f"\n  {label} " in proc.stdout, proc.stdout
    assert proc.stdout.rstrip().endswith("hpcdl doctor: nothing to fix")


def test_two_ranks_on_one_node(tmp_path):
    proc = run_doctor("--json", "--stage-dir", tmp_path, prefix=mpirun_cmd(2))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert (report["world_size"], report["num_nodes"]) == (2, 1)
    assert report["nodes"][0]["ranks"] == [0, 1]
    assert report["nodes"][0]["facts"]["blas"]["threads"] == 1


def test_blas_threads_beyond_the_cores_are_one_warning_per_job(tmp_path):
    threads = str(2 * (os.cpu_count() or 1))
    env = doctor_env(OMP_NUM_THREADS=threads, OPENBLAS_NUM_THREADS=threads)
    proc = run_doctor("--stage-dir", tmp_path, prefix=mpirun_cmd(2), env=env)
    lines = problem_lines(proc.stdout)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert (
        len(lines) == 1
        and "BLAS threads" in lines[0]
        and "fix: export OMP_NUM_THREADS=" in lines[0]
    )
    assert lines[0].endswith("[ranks 0-1]"), lines


def test_without_a_thread_variable_the_threads_training_will_set_are_shown_and_fit(tmp_path):
    env = doctor_env(OMP_NUM_THREADS=None, OPENBLAS_NUM_THREADS=None, MKL_NUM_THREADS=None)
    env.pop("SLURM_CPUS_PER_TASK", None)
    proc = run_doctor("--json", "--stage-dir", tmp_path, prefix=mpirun_cmd(2), env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    blas = report["nodes"][0]["facts"]["blas"]
    assert 1 <= blas["threads"] <= blas["cores"], blas
    assert "core(s)" in blas["reason"] and "environment" not in blas["reason"], blas
    assert not [p for p in report["problems"] if "BLAS" in p["message"]], report["problems"]


@pytest.mark.parametrize("binary", ["missing", "not_the_stager"])
def test_stager_that_cannot_run_is_an_error(binary, tmp_path):
    path = tmp_path / "no-such-hpcdl-stage" if binary == "missing" else shutil.which("false")
    proc = run_doctor("--stage-dir", tmp_path, env=doctor_env(HPCDL_STAGE_BIN=str(path)))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = problem_lines(proc.stdout)
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stdout
    assert str(path) in lines[0] and "; fix: " in lines[0], lines


def test_stage_dir_under_a_regular_file_is_an_error(tmp_path):
    (tmp_path / "file").write_text("a user's file\n")
    proc = run_doctor("--stage-dir", tmp_path / "file" / "stage")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = problem_lines(proc.stdout)
    assert len(lines) == 1, proc.stdout
    assert "is not a directory" in lines[0] and "fix: pass --stage-dir" in lines[0], lines
    assert (tmp_path / "file").read_text() == "a user's file\n"


def test_missing_stage_dir_is_probed_and_removed_again(tmp_path):
    proc = run_doctor("--json", "--stage-dir", tmp_path / "a" / "b")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(proc.stdout)["nodes"][0]["facts"]["stage_dir"]["writable"] is True
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("exists", [True, False], ids=["existing", "to_be_created"])
def test_read_only_stage_dir_is_an_error(exists, tmp_path):
    """A read-only bind mount in a private mount namespace (root ignores permission bits)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    stage = ro if exists else ro / "stage"
    doctor = shlex.join([*DOCTOR, "--stage-dir", str(stage)])
    script = f"mount --bind {ro} {ro} && mount -o remount,ro,bind {ro} && {doctor}"
    proc = subprocess.run(
        ["unshare", "--mount", "sh", "-c", script],
        capture_output=True,
        text=True,
        env=doctor_env(),
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = problem_lines(proc.stdout)
    assert lines == [
        f"error: stage dir {stage} is not writable (Read-only file system); fix: pass "
        "--stage-dir a node-local directory ($SLURM_TMPDIR, a local SSD, /tmp)"
    ], proc.stdout


def test_stage_dir_on_tmpfs_is_node_local_in_ram(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    doctor = shlex.join([*DOCTOR, "--json", "--stage-dir", str(mnt)])
    proc = subprocess.run(
        [
            "unshare",
            "--mount",
            "sh",
            "-c",
            f"mount -t tmpfs -o size=2G hpcdl-test {mnt} && {doctor}",
        ],
        capture_output=True,
        text=True,
        env=doctor_env(),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    stage = json.loads(proc.stdout)["nodes"][0]["facts"]["stage_dir"]
    assert (stage["fs_type"], stage["kind"], stage["mount_point"]) == ("tmpfs", "memory", str(mnt))
    assert stage["total_bytes"] == 2 << 30


def test_stage_dir_on_nfs_is_a_warning_with_the_fix(tmp_path):
    """The mount table says NFS; the directory, its free space and the probe are real."""
    mounts = (
        "/dev/vda / ext4 rw,relatime 0 0\n"
        f"fileserver:/export/scratch {tmp_path} nfs4 rw,vers=4.2,addr=10.0.0.1 0 0\n"
    )
    facts, problems = check_stage_dir(str(tmp_path / "stage"), "--stage-dir", mounts)
    assert (facts["fs_type"], facts["kind"], facts["writable"]) == ("nfs4", "network", True)
    assert problems == [
        Problem(
            WARNING,
            f"stage dir {tmp_path / 'stage'} is on nfs4 (fileserver:/export/scratch at "
            f"{tmp_path}), shared between nodes, not node-local: staging only adds copies; fix: "
            "pass --stage-dir a node-local directory ($SLURM_TMPDIR, a local SSD, /tmp)",
        )
    ]
    assert exit_status(problems) == 1
    assert not (tmp_path / "stage").exists()


@pytest.mark.parametrize(
    "fstype,kind",
    [("nfs", "network"), ("lustre", "network"), ("gpfs", "network"), ("beegfs", "network")]
    + [("fuse.sshfs", "network"), ("ext4", "local"), ("xfs", "local"), ("tmpfs", "memory")],
)
def test_classify(fstype, kind):
    assert classify(fstype) == kind


def test_mount_table_parsing_and_longest_match():
    mounts = parse_mounts(
        "/dev/sda1 / ext4 rw 0 0\n"
        "10.1.1.1@o2ib:/scratch /scratch lustre rw,flock 0 0\n"
        "/dev/nvme0n1 /scratch/local\\040ssd xfs rw 0 0\n"
    )
    assert mount_of("/scratch/u/run", mounts).fstype == "lustre"
    assert mount_of("/scratch/local ssd/job", mounts).fstype == "xfs"
    assert mount_of("/scratchy", mounts).fstype == "ext4"
    assert mount_of("/", mounts).point == "/"


def test_real_mounts_are_read():
    mounts = parse_mounts(read_mounts())
    assert mount_of("/proc/self", mounts).fstype == "proc"
    facts, problems = check_stage_dir("/dev/shm", "--stage-dir", read_mounts())
    assert facts["kind"] == "memory" and facts["writable"], facts
    assert not problems


def test_merge_lists_differing_facts_per_rank_and_problems_once():
    def report(rank: int, host: str, gpu: int) -> dict:
        problem = Problem(WARNING, "w; fix: f").to_dict()
        return {
            "host": host,
            "rank": rank,
            "facts": {"mpi": "x", "gpu": gpu},
            "problems": [problem],
        }

    merged = merge([report(0, "a", 0), report(1, "a", 1), report(2, "b", 0)])
    a, b = merged["nodes"]
    assert (a["ranks"], a["facts"], a["per_rank"]) == (
        [0, 1],
        {"mpi": "x"},
        {"0": {"gpu": 0}, "1": {"gpu": 1}},
    )
    assert (b["facts"], b["per_rank"]) == ({"mpi": "x", "gpu": 0}, {})
    assert merged["problems"] == [
        {"level": WARNING, "message": "w; fix: f", "ranks": [0, 1, 2], "nodes": ["a", "b"]}
    ]
    assert merged["status"] == 1


def test_exit_status_and_rank_ranges():
    assert exit_status([]) == 0
    assert exit_status([Problem(WARNING, "w"), Problem(ERROR, "e")]) == 2
    assert rank_ranges([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"


def test_slurm_variables_against_the_mpi_world(tmp_path):
    """What a job step gets when the tasks were not launched as one MPI job (e.g. plain python
    in an sbatch script of --ntasks=4 --nodes=2 --cpus-per-task=N, N more than this machine)."""
    cores = len(os.sched_getaffinity(0))
    env = doctor_env(
        SLURM_JOB_ID="77",
        SLURM_NTASKS="4",
        SLURM_NNODES="2",
        SLURM_CPUS_PER_TASK=str(cores + 1),
    )
    proc = run_doctor("--stage-dir", tmp_path, env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = problem_lines(proc.stdout)
    assert [line.split(" but ")[0] for line in lines] == [
        "warning: SLURM_NTASKS=4",
        "warning: SLURM_NNODES=2",
        f"warning: SLURM_CPUS_PER_TASK={cores + 1}",
    ], lines
    assert all("; fix: " in line for line in lines), lines
    assert "job 77: SLURM_NTASKS=4" in proc.stdout


def test_text_lists_a_fact_per_rank_where_ranks_differ(tmp_path):
    """Two ranks whose GPU binding differs (as on a GPU node), built from this machine's facts."""
    from hpcdl.doctor.__main__ import render  # noqa: PLC0415

    proc = run_doctor("--json", "--stage-dir", tmp_path)
    facts = json.loads(proc.stdout)["nodes"][0]["facts"]
    reports = []
    for rank in (0, 1):
        gpus = {**facts["gpus"], "visible": 2, "bound": rank, "name": "NVIDIA H100"}
        reports.append(
            {"host": "n1", "rank": rank, "facts": {**facts, "gpus": gpus}, "problems": []}
        )
    lines = render(merge(reports)).splitlines()
    assert lines[1] == "node n1, ranks 0-1"
    gpu_lines = [line for line in lines if line.startswith("  GPUs")]
    assert [line.split(": ")[0] for line in gpu_lines] == [
        "  GPUs        rank 0",
        "  GPUs        rank 1",
    ]
    assert "binds GPU 1 (NVIDIA H100)" in gpu_lines[1]
    assert sum(line.startswith("  MPI ") for line in lines) == 1


@pytest.mark.parametrize(  # fmt: skip
    ("cudnn", "on", "setting", "expected"),
    [
        ("9.19.0", True, None, "; cuDNN 9.19.0; fast kernels and CUDA graphs of the step on"),
        (
            None,
            False,
            None,
            "; cuDNN frontend not installed; fast kernels and CUDA graphs of the step off "
            "(--gpu-kernels or HPCDL_GPU_KERNELS=1)",
        ),
        (
            "9.19.0",
            True,
            "tf32",
            "; fast kernels and CUDA graphs of the step on; float32 on TF32 tensor cores "
            "(HPCDL_TF32)",
        ),
        (
            "9.19.0",
            True,
            "deterministic",
            "; fast kernels and CUDA graphs of the step on; deterministic cuDNN engines "
            "(HPCDL_DETERMINISTIC)",
        ),
        (
            "9.19.0",
            True,
            "autotune",
            "; fast kernels and CUDA graphs of the step on; cuDNN's first 8 engines timed per "
            "convolution (HPCDL_CUDNN_AUTOTUNE)",
        ),
        (
            "9.19.0",
            True,
            "half_wgrad",
            "; fast kernels and CUDA graphs of the step on; bf16/fp16 weight gradients in the "
            "format (HPCDL_HALF_WGRAD)",
        ),
    ],
)
def test_the_gpu_line_names_cudnn_and_whether_graphs_are_on(tmp_path, cudnn, on, setting, expected):
    """On a GPU node (CuPy present) the line carries cuDNN's version, --gpu-kernels and, where
    HPCDL_TF32 set it, that float32 runs on TF32 tensor cores (NOTE [TF32]); where
    HPCDL_DETERMINISTIC did, that cuDNN's engines are the deterministic ones."""
    from hpcdl.doctor.__main__ import render  # noqa: PLC0415

    proc = run_doctor("--json", "--stage-dir", tmp_path)
    facts = json.loads(proc.stdout)["nodes"][0]["facts"]
    assert {"cudnn", "gpu_kernels", "tf32", "deterministic", "autotune"} <= set(facts["gpus"])
    assert facts["gpus"]["tf32"] is facts["gpus"]["deterministic"] is False  # neither set here
    assert facts["gpus"]["autotune"] == 0 and facts["gpus"]["half_wgrad"] is False
    gpus = {**facts["gpus"], "cupy": "14.0.0", "cudnn": cudnn, "gpu_kernels": on,
            "tf32": setting == "tf32", "deterministic": setting == "deterministic",
            "autotune": 8 if setting == "autotune" else 0,
            "half_wgrad": setting == "half_wgrad"}  # fmt: skip
    report = {"host": "n1", "rank": 0, "facts": {**facts, "gpus": gpus}, "problems": []}
    gpu_line = next(line for line in render(merge([report])).splitlines() if "GPUs" in line)
    assert gpu_line.endswith(expected), gpu_line


def test_cudnn_versions_read_as_major_minor_patch(monkeypatch):
    from hpcdl.doctor import probes  # noqa: PLC0415
    from hpcdl.nn.kernels import cudnn_graphs  # noqa: PLC0415

    monkeypatch.setattr(cudnn_graphs, "version", lambda: "91900")
    assert probes.cudnn_version() == "9.19.0"
    monkeypatch.setattr(cudnn_graphs, "version", lambda: None)
    assert probes.cudnn_version() is None
