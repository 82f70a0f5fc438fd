"""`hpcdl.train --stage-dir` end to end with the real hpcdl-stage, MPI, HDF5 and file systems.

A full file system (a 200 KiB tmpfs in a private mount namespace), a SIGKILLed stager, a capacity
below the data set size and the per-epoch staging figures of the metrics file.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import mpi_env, read_events, run_train, stage_bytes, temp_files, train_cmd

from hpcdl import checkpoint
from hpcdl.data.convert import write_dataset
from hpcdl.staging import status as codes  # its codes on use: collects without a stager
from hpcdl.staging.status import StatusView

TMPFS_SIZE = 200 * 1024
NOSPACE_TEXT = "No space left on device; staging stops growing, the remaining files are read"
DEAD_TEXT = "the staging process stopped; files not yet staged in"

# Runs argv[3:] inside the mount namespace, then records the stage dir (argv[2]) before the
# namespace (and its tmpfs) goes away: every file with its size and sha256, the status map.
INSPECT = r"""
import hashlib, json, os, subprocess, sys
from hpcdl.staging.status import StatusView
out, stage, cmd = sys.argv[1], sys.argv[2], sys.argv[3:]
proc = subprocess.run(cmd, capture_output=True, text=True)
files = {}
for d, _, names in os.walk(stage):
    for name in names:
        path = os.path.join(d, name)
        with open(path, "rb") as f:
            files[os.path.relpath(path, stage)] = hashlib.sha256(f.read()).hexdigest()
import glob
found = glob.glob(os.path.join(glob.escape(stage), ".hpcdl", "sessions", "*", "status"))
view = StatusView(found[0] if found else os.path.join(stage, "missing"))
vfs = os.statvfs(stage)
result = dict(rc=proc.returncode, stdout=proc.stdout, stderr=proc.stderr, files=files,
              fs_bytes=vfs.f_blocks * vfs.f_frsize,
              header=view.header() if view.open() else None, states=list(view.states()))
with open(out, "w") as f:
    json.dump(result, f)
"""


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def final_params(ckpt_dir: Path) -> np.ndarray:
    return checkpoint.load(checkpoint.latest(ckpt_dir)).params


def data_files(stage: Path) -> dict[str, Path]:
    """Staged data files (under the data key directory, not .hpcdl/): path in the data set ->
    path in the stage dir."""
    out = {}
    for d, _, names in os.walk(stage):
        parts = Path(d).relative_to(stage).parts
        if not parts or parts[0] == ".hpcdl":
            continue
        for name in names:
            out[str(Path(*parts[1:], name))] = Path(d) / name
    return out


def status_path(stage: Path, timeout: float = 120.0) -> Path:
    """The status map of the one job session in stage, waiting until it exists."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = sorted(stage.glob(".hpcdl/sessions/*/status"))
        if found:
            return found[0]
        time.sleep(0.005)
    raise AssertionError(f"no session status map appeared in {stage}")


# ---------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def big_dir(tmp_path_factory) -> Path:
    """16 HDF5 shards of 100 random 16x16 uint8 images (~520 KB): larger than the tmpfs."""
    out = tmp_path_factory.mktemp("big")
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (1600, 16, 16, 1), dtype=np.uint8)
    labels = rng.integers(0, 10, 1600).astype(np.int64)
    write_dataset(out, {"train": (images, labels)}, [str(i) for i in range(10)], shard_size=100)
    assert sum(p.stat().st_size for p in (out / "train").iterdir()) > 2 * TMPFS_SIZE
    return out / "train"


@pytest.fixture(scope="module")
def small_fs(tmp_path_factory):
    """Runs a command with a fresh 200 KiB tmpfs mounted on a directory (mount namespace)."""
    probe = tmp_path_factory.mktemp("probe")
    try:
        proc = subprocess.run(
            ["unshare", "-m", "sh", "-c", f'mount -t tmpfs -o size={TMPFS_SIZE} tmpfs "$0"', probe],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except FileNotFoundError as exc:
        pytest.skip(f"cannot mount a small tmpfs: {exc}")
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs (needs root and unshare): {proc.stderr.strip()}")

    def run(stage: Path, cmd: list, out: Path) -> dict:
        stage.mkdir()
        proc = subprocess.run(
            [
                "unshare",
                "-m",
                "sh",
                "-c",
                f'mount -t tmpfs -o size={TMPFS_SIZE} tmpfs "$0" && exec "$@"',
                stage,
                sys.executable,
                "-c",
                INSPECT,
                out,
                stage,
                *map(str, cmd),
            ],
            capture_output=True,
            text=True,
            env=mpi_env(),
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        result = json.loads(out.read_text())
        assert result["fs_bytes"] == TMPFS_SIZE  # it really ran on the small tmpfs
        assert not any(stage.iterdir())  # and the tmpfs is gone with the namespace
        return result

    return run


# ---------------------------------------------------------------------------------- ENOSPC


def check_enospc_result(result: dict, data: Path) -> set[str]:
    """Checks shared by the stage-only and the training runs; returns the staged relpaths."""
    sources = {p.name: p for p in data.iterdir()}
    assert not [r for r in result["files"] if Path(r).name.startswith("tmp.")], result["files"]
    copies = {  # name in the data set -> sha256 of its copy (under the data key directory)
        rel.split("/", 1)[1]: digest
        for rel, digest in result["files"].items()
        if not rel.startswith(".hpcdl")
    }
    staged = set(copies)
    assert 0 < len(staged) < len(sources), staged
    for rel in staged:  # published copies are complete
        assert copies[rel] == sha256(sources[rel]), rel
    assert result["stderr"].count(NOSPACE_TEXT) == 1, result["stderr"]
    header, states = result["header"], result["states"]
    assert header["flags"] & codes.FLAG_NOSPACE, header
    assert header["files_staged"] + header["files_reused"] == len(staged)
    assert header["failures"] == 0
    # The capacity shrank to what is resident; everything else stays PENDING (read from the PFS).
    staged_bytes = sum(sources[rel].stat().st_size for rel in staged)
    assert header["bytes_resident"] == header["capacity"] == staged_bytes, header
    assert states.count(codes.READY) == len(staged)
    assert states.count(codes.PENDING) == len(sources) - len(staged), states
    return staged


def test_stage_only_into_a_full_file_system_stops_growing_with_a_clear_message(
    big_dir, small_fs, tmp_path
):
    result = small_fs(
        tmp_path / "stage",
        [
            sys.executable,
            "-m",
            "hpcdl.stage",
            "--data",
            big_dir,
            "--stage-dir",
            tmp_path / "stage",
            "--stage-capacity",
            "10M",  # more than the tmpfs holds: the file system says no first
            "--json",
        ],
        tmp_path / "inspect.json",
    )
    assert result["rc"] == 0, result["stderr"]
    staged = check_enospc_result(result, big_dir)
    summary = json.loads(result["stdout"].splitlines()[-1])
    assert summary["no_space"] is True and summary["failures"] == 0, summary
    assert summary["files"] == len(staged) and summary["planned"] == 16, summary
    assert "files left on the PFS (no space left)" in result["stdout"]


def test_training_into_a_full_file_system_reads_the_rest_from_the_pfs(big_dir, small_fs, tmp_path):
    common = ["--data", big_dir, "--model", "mlp", "--epochs", 2, "--batch-size", 32]
    common += ["--workers", 0, "--seed", 1, "--quiet"]
    plain = run_train(1, *common, "--checkpoint-dir", tmp_path / "plain")
    assert plain.returncode == 0, plain.stderr[-3000:]
    metrics = tmp_path / "m.jsonl"
    result = small_fs(
        tmp_path / "stage",
        train_cmd(
            1,
            *common,
            "--checkpoint-dir",
            tmp_path / "staged",
            "--metrics",
            metrics,
            "--stage-dir",
            tmp_path / "stage",
            "--stage-capacity",
            "10M",
            "--keep-staged",  # leave the copies and the status map for the inspection
        ),
        tmp_path / "inspect.json",
    )
    assert result["rc"] == 0, result["stderr"][-3000:]
    assert "Traceback" not in result["stderr"] and "Warning" not in result["stderr"]
    check_enospc_result(result, big_dir)
    staging = read_events(metrics, "summary")[0]["staging"]
    assert staging["hits"] > 0 and staging["misses"] > 0 and staging["stager_alive"], staging
    np.testing.assert_array_equal(
        final_params(tmp_path / "plain"), final_params(tmp_path / "staged")
    )


def test_a_stage_file_system_full_at_start_trains_from_the_pfs_with_one_warning(
    digits_dir, small_fs, tmp_path
):
    common = ["--data", digits_dir / "train", "--model", "mlp", "--epochs", 1]
    common += ["--batch-size", 32, "--workers", 0, "--seed", 2, "--quiet"]
    plain = run_train(1, *common, "--checkpoint-dir", tmp_path / "plain")
    assert plain.returncode == 0, plain.stderr[-3000:]
    stage = tmp_path / "stage"
    fill = f'head -c {TMPFS_SIZE} /dev/zero > "{stage}/filler" 2>/dev/null; exec "$@"'
    result = small_fs(
        stage,
        ["sh", "-c", fill, "sh"]
        + train_cmd(
            1, *common, "--checkpoint-dir", tmp_path / "staged", "--stage-dir", stage / "st"
        ),
        tmp_path / "inspect.json",
    )
    assert result["rc"] == 0, result["stderr"][-3000:]
    assert "Traceback" not in result["stderr"], result["stderr"]
    warnings = [line for line in result["stderr"].splitlines() if "RuntimeWarning" in line]
    assert len(warnings) == 1 and "read from the parallel file system" in warnings[0], warnings
    assert "no space left" in warnings[0].lower(), warnings
    assert list(result["files"]) == ["filler"]  # nothing of hpcdl's is left behind
    np.testing.assert_array_equal(
        final_params(tmp_path / "plain"), final_params(tmp_path / "staged")
    )


# ---------------------------------------------------------------------------------- SIGKILL


def test_sigkill_to_the_stager_mid_run_falls_back_to_the_pfs_with_the_same_parameters(
    digits_dir, tmp_path
):
    # 6 epochs: the kill lands at the first published copy, in the run's first second, and
    # the epochs after it read the copies published before it (hits) and the PFS (misses)
    common = ["--data", digits_dir / "train", "--model", "mlp", "--epochs", 6]
    common += ["--batch-size", 8, "--workers", 1, "--seed", 5, "--quiet"]
    plain = run_train(2, *common, "--checkpoint-dir", tmp_path / "plain")
    assert plain.returncode == 0, plain.stderr[-3000:]

    stage, metrics = tmp_path / "stage", tmp_path / "m.jsonl"
    env = mpi_env()
    # ~35 KB shards at 0.1 MB/s through one rate limiter: one copy done every ~0.35 s.
    env["HPCDL_STAGE_EMULATE_PFS"] = "latency_ms=20,mbps=0.1"
    job = subprocess.Popen(
        train_cmd(
            2,
            *common,
            "--checkpoint-dir",
            tmp_path / "staged",
            "--metrics",
            metrics,
            "--stage-dir",
            stage,
            "--keep-staged",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    status = StatusView(status_path(stage))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and job.poll() is None:
        if status.field("run_state") == codes.RUN_RUNNING and status.field("plan_ready") >= 1:
            break
        time.sleep(0.005)
    pid = status.field("pid")
    assert job.poll() is None and pid > 0 and status.field("plan_ready") >= 1, job.poll()
    os.kill(pid, signal.SIGKILL)
    in_flight = temp_files(stage)
    ready_at_kill = [i for i, s in enumerate(status.states()) if s == codes.READY]
    still_training = job.poll() is None
    out, err = job.communicate(timeout=300)
    status.close()

    assert still_training  # the kill really came mid-run
    assert in_flight, "no copy was in flight when the stager was killed"
    assert job.returncode == 0, err[-3000:]
    assert "Traceback" not in err
    # One warning per node (from its local rank 0), naming the fallback.
    warnings = [line for line in err.splitlines() if "RuntimeWarning" in line]
    assert len(warnings) == 1 and all(DEAD_TEXT in w for w in warnings), err[-3000:]
    assert all("read from the parallel file system" in w for w in warnings)
    # The killed stager's temporaries are gone; the copies it published are intact and kept.
    assert temp_files(stage) == []
    kept = data_files(stage)
    assert len(kept) == len(ready_at_kill) >= 1, (kept, ready_at_kill)
    for rel, path in kept.items():
        assert sha256(path) == sha256(digits_dir / "train" / rel)
    staging = read_events(metrics, "summary")[0]["staging"]
    assert not staging["stager_alive"], staging
    assert staging["hits"] > 0 and staging["misses"] > 0, staging
    np.testing.assert_array_equal(
        final_params(tmp_path / "plain"), final_params(tmp_path / "staged")
    )


def test_the_stager_says_one_start_and_one_stop_line_per_node_naming_it(digits_dir, tmp_path):
    common = ["--data", digits_dir / "train", "--model", "mlp", "--epochs", 4]
    common += ["--batch-size", 16, "--workers", 0, "--quiet"]
    proc = run_train(2, *common, "--stage-dir", tmp_path / "stage")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("hpcdl-stage")]
    prefix = f"hpcdl-stage on {socket.gethostname()}: "
    assert len(lines) == 2 and all(line.startswith(prefix) for line in lines), lines
    assert lines[0].startswith(prefix + "staging ") and lines[1].startswith(
        prefix + "finished (the job ended)"
    )


# ---------------------------------------------------------------------------------- capacity


def test_capacity_below_the_data_set_size_is_respected_through_the_trainer(digits_dir, tmp_path):
    shards = sorted((digits_dir / "train").iterdir())
    sizes = sorted(p.stat().st_size for p in shards)
    capacity = sizes[0] + sizes[1] + 1000  # two shards of four fit
    assert capacity < sum(sizes)
    stage, metrics = tmp_path / "stage", tmp_path / "m.jsonl"
    job = subprocess.Popen(
        train_cmd(
            1,
            "--data",
            digits_dir / "train",
            "--model",
            "mlp",
            "--epochs",
            4,
            "--batch-size",
            16,
            "--workers",
            0,
            "--quiet",
            "--stage-dir",
            stage,
            "--stage-capacity",
            capacity,
            "--keep-staged",
            "--metrics",
            metrics,
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=mpi_env(),
    )
    peak = {"disk": 0, "resident": 0, "samples": 0}

    def watch():
        view = StatusView(status_path(stage))
        while job.poll() is None:
            if stage.exists():
                peak["disk"] = max(peak["disk"], stage_bytes(stage))
                peak["resident"] = max(peak["resident"], view.field("bytes_resident"))
                peak["samples"] += 1
            time.sleep(0.002)
        view.close()

    watcher = threading.Thread(target=watch)
    watcher.start()
    out, err = job.communicate(timeout=300)
    watcher.join()
    assert job.returncode == 0, err[-3000:]
    assert peak["samples"] > 0
    assert 0 < peak["resident"] <= capacity and peak["disk"] <= capacity, peak

    view = StatusView(status_path(stage))
    header = view.header()
    view.close()
    assert header["capacity"] == capacity and header["flags"] & codes.FLAG_CAPACITY_FULL, header
    assert 0 < header["bytes_resident"] <= capacity
    assert 0 < sum(p.stat().st_size for p in data_files(stage).values()) <= capacity
    assert temp_files(stage) == []

    epochs = read_events(metrics, "epoch")
    summary = read_events(metrics, "summary")[0]["staging"]
    assert summary["hits"] > 0 and summary["misses"] > 0, summary
    hit_rate = summary["hits"] / (summary["hits"] + summary["misses"])
    assert 0.2 < hit_rate < 0.8, summary  # about half of each batch comes from the 2 of 4 shards
    assert 0 < summary["files_staged"] < len(shards)
    assert 0 < summary["bytes_staged"] <= capacity  # nothing was evicted to make room
    assert [e["staging"]["bytes_staged"] <= capacity for e in epochs] == [True] * 4


# ---------------------------------------------------------------------------------- metrics


def test_epoch_events_carry_cumulative_staging_figures_after_a_stage_only_run(digits_dir, tmp_path):
    data, stage, metrics = digits_dir / "train", tmp_path / "stage", tmp_path / "m.jsonl"
    shards = sorted(data.iterdir())
    total = sum(p.stat().st_size for p in shards)
    pre = subprocess.run(
        [sys.executable, "-m", "hpcdl.stage", "--data", data, "--stage-dir", stage]
        + ["--stage-capacity", "10M", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert pre.returncode == 0, pre.stderr
    assert json.loads(pre.stdout.splitlines()[-1])["copied"] == len(shards)

    batch, epochs = 16, 3
    proc = run_train(
        1,
        "--data",
        data,
        "--model",
        "mlp",
        "--epochs",
        epochs,
        "--batch-size",
        batch,
        "--workers",
        1,
        "--quiet",
        "--stage-dir",
        stage,
        "--stage-capacity",
        "10M",
        "--metrics",
        metrics,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = read_events(metrics, "start")[0]["steps_per_epoch"]
    events = read_events(metrics, "epoch")
    assert [e["epoch"] for e in events] == list(range(epochs))
    previous_hits = 0
    for e in events:
        s = e["staging"]
        assert set(s) >= {"files_staged", "bytes_staged", "hits", "misses", "stager_alive"}, s
        # Every file was reused from the stage-only run; every read is a local hit.
        assert s["files_staged"] == len(shards) and s["bytes_staged"] == total, s
        assert s["misses"] == 0 and s["stager_alive"], s
        # Cumulative: the workers go on into the next epoch while this one ends (hpcdl.data.pool
        # NOTE [the next epoch]), so an epoch's own lookups may be counted in the one before.
        assert s["hits"] > previous_hits, (s, previous_hits)
        previous_hits = s["hits"]
    # At least one lookup per step, at most one per shard and step, over the run.
    assert steps * epochs <= previous_hits <= steps * epochs * len(shards), (previous_hits, steps)
    summary = read_events(metrics, "summary")[0]["staging"]
    assert summary["hits"] == events[-1]["staging"]["hits"], summary
    assert not stage.exists() or data_files(stage) == {}  # copies removed at the end


def test_staging_progress_events_show_staging_ahead_of_the_readers_in_the_report(
    digits_dir, tmp_path
):
    """A real staged run writes `staging` events; hpcdl.report draws and summarises them."""
    metrics, stage = tmp_path / "m.jsonl", tmp_path / "stage"
    proc = run_train(
        2,
        "--data",
        digits_dir / "train",
        "--model",
        "mlp",
        "--epochs",
        3,
        "--batch-size",
        16,
        "--workers",
        1,
        "--quiet",
        "--metrics-every",
        1,
        "--stage-dir",
        stage,
        "--metrics",
        metrics,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = read_events(metrics, "staging")
    steps = read_events(metrics, "step")
    assert len(events) == len(steps) > 0
    shards = len(list((digits_dir / "train").iterdir()))
    for e in events:
        assert 0 <= e["files_ready"] <= e["plan_files"] <= shards
        assert 0 <= e["consumed_files"] <= e["plan_files"]
    assert events[-1]["files_ready"] == events[-1]["plan_files"]  # all staged by the end
    assert max(e["consumed_files"] for e in events) > 0

    png = tmp_path / "report.png"
    report = subprocess.run(
        [sys.executable, "-m", "hpcdl.report", metrics, "--out", png],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert report.returncode == 0, report.stderr
    assert "staging ahead of the readers by" in report.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_capacity_zero_stages_nothing_and_two_ranks_train_from_the_pfs(digits_dir, tmp_path):
    stage, metrics = tmp_path / "stage", tmp_path / "m.jsonl"
    proc = run_train(
        2,
        "--data",
        digits_dir / "train",
        "--model",
        "mlp",
        "--epochs",
        2,
        "--batch-size",
        16,
        "--workers",
        0,
        "--quiet",
        "--stage-dir",
        stage,
        "--stage-capacity",
        0,
        "--keep-staged",
        "--metrics",
        metrics,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "final train loss" in proc.stdout
    assert data_files(stage) == {}
    header = StatusView(status_path(stage)).header()
    assert header["capacity"] == 0 and header["files_staged"] == 0, header
    summary = read_events(metrics, "summary")[0]
    assert summary["staging"]["files_staged"] == 0 and summary["staging"]["hits"] == 0
    assert summary["staging"]["misses"] > 0
    capacity_lines = [line for line in proc.stderr.splitlines() if "do not fit" in line]
    assert len(capacity_lines) == 1, proc.stderr[-3000:]
