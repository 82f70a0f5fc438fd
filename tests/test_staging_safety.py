"""Data safety of staging: hpcdl deletes only what it created and reuses only bytes it knows.

Real hpcdl-stage processes, real files and real `mpirun` jobs; no mocks. Each case here was a
data loss or a wrong-bytes bug (issue 19, items 1-3 and 7).
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import make_tree, mpi_env, own_lines, run_train, start_session, train_cmd, wait_ready

from hpcdl import checkpoint
from hpcdl.staging import StagingSession
from hpcdl.staging.binary import find_stager_binary
from hpcdl.staging.layout import StageDir
from hpcdl.staging.ownership import StageDirLease


def snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under root (not following symlinks) -> (bytes, mode), plus directory modes."""
    out = {}
    for d, dirs, files in os.walk(root):
        out[os.path.relpath(d, root) + "/"] = (b"", stat.S_IMODE(os.lstat(d).st_mode))
        for name in files + [x for x in dirs if os.path.islink(os.path.join(d, x))]:
            path = os.path.join(d, name)
            data = b"link" if os.path.islink(path) else Path(path).read_bytes()
            out[os.path.relpath(path, root)] = (data, stat.S_IMODE(os.lstat(path).st_mode))
    return out


def assert_one_error_line(proc: subprocess.CompletedProcess, prefix: str) -> str:
    """Exit status 2, no traceback, at most 2 lines of hpcdl's own; returns the error line."""
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    assert "Traceback" not in output, output
    errors = [line for line in own_lines(output) if "error" in line]
    assert len(own_lines(output)) <= 2 and len(errors) == 1, output
    assert errors[0].startswith(prefix), output
    return errors[0]


def served(session: StagingSession, ds) -> list[bytes]:
    locate = session.locator()
    return [Path(locate(fid)).read_bytes() for fid in range(len(ds.files))]


def sources(ds) -> list[bytes]:
    return [(ds.root / f.relpath).read_bytes() for f in ds.files]


# ------------------------------------------------------------- 1: delete only what it created


def test_stage_dir_names_are_the_documented_on_disk_layout(tmp_path):
    lease = StageDirLease.acquire(tmp_path / "stage")
    stage = StageDir(lease.stage_dir)
    try:
        meta = lease.stage_dir / ".hpcdl"  # docs/staging.md, "Stage dir layout and ownership"
        assert (stage.meta, stage.lock, stage.created) == (meta, meta / "lock", meta / "created")
        assert stage.manifest == meta / "manifest"
        files = stage.session(lease.session)
        assert files == lease.files and files.path == meta / "sessions" / lease.session
        names = (files.plan, files.status, files.progress, files.counters, files.owner)
        assert [p.name for p in names] == ["plan", "status", "progress", "counters", "owner"]
        assert stage.lock.is_file() and stage.created.is_file() and files.owner.is_file()
    finally:
        lease.release(keep=False)
    assert not (tmp_path / "stage").exists()


@pytest.mark.parametrize("where", ["same", "inside", "contains"])
def test_a_stage_dir_overlapping_the_data_is_refused_in_one_line_and_loses_nothing(
    digits_dir, tmp_path, where
):
    data = tmp_path / "d"
    subprocess.run(["cp", "-r", str(digits_dir), str(data)], check=True)
    stage = {"same": data / "train", "inside": data / "train" / "st", "contains": data}[where]
    before = snapshot(data)
    proc = run_train(
        2,
        *("--data", data / "train", "--val-data", data / "val", "--model", "mlp"),
        *("--epochs", 1, "--stage-dir", stage),
        timeout=120,
    )
    assert_one_error_line(proc, "hpcdl.train: error: --stage-dir")
    assert "rank(s) on" not in proc.stdout, proc.stdout  # a config error comes before the start
    assert snapshot(data) == before


def test_stage_only_refuses_a_stage_dir_equal_to_the_data(tmp_path):
    ds = make_tree(tmp_path / "pfs", 6, 100)
    before = snapshot(ds.root)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "hpcdl.stage",
            "--data",
            ds.root,
            "--files-only",
            "--batch-size",
            "1",
        ]
        + ["--stage-dir", ds.root / "d0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "hpcdl.stage: error:" in proc.stderr, proc.stderr
    assert "overlaps" in proc.stderr
    assert snapshot(ds.root) == before


def test_cleanup_never_deletes_through_a_symlinked_directory(tmp_path):
    ds = make_tree(tmp_path / "pfs", 8, 100, dirs=2)
    victim = tmp_path / "victim"
    victim.mkdir()
    for entry in ds.files:  # files with the names the stager would write under d1/
        (victim / Path(entry.relpath).name).write_bytes(b"precious")
    stage = tmp_path / "stage"
    stage.mkdir()
    (stage / "d1").symlink_to(victim, target_is_directory=True)
    before = snapshot(victim)
    session = start_session(ds, stage)
    wait_ready(session, 1)
    assert served(session, ds) == sources(ds)
    session.close()
    assert snapshot(victim) == before
    assert (stage / "d1").is_symlink()  # not ours: left where it was


def test_files_that_were_in_the_stage_dir_before_are_never_reused_changed_or_deleted(tmp_path):
    ds = make_tree(tmp_path / "pfs", 8, 100, dirs=1)
    stage = tmp_path / "stage"
    stage.mkdir(mode=0o755)
    for entry in ds.files:  # same size and mtime as the source, other bytes
        src = ds.root / entry.relpath
        for dst in (stage / entry.relpath,):
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(bytes(255 - b for b in src.read_bytes()))
            st = src.stat()
            os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))
    before = snapshot(stage)
    session = start_session(ds, stage)
    wait_ready(session, len(ds.files))
    assert served(session, ds) == sources(ds)
    session.close()
    assert snapshot(stage) == before  # mode 0755 kept, user files untouched


def test_a_file_changed_in_place_after_staging_is_staged_again(tmp_path):
    ds = make_tree(tmp_path / "pfs", 6, 100, dirs=1)
    stage = tmp_path / "stage"
    first = start_session(ds, stage, keep=True)
    wait_ready(first, 6)
    first.close()
    src = ds.root / ds.files[0].relpath
    st = src.stat()
    src.write_bytes(bytes(255 - b for b in src.read_bytes()))  # same size
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))  # same mtime: only ctime tells
    second = start_session(ds, stage)
    wait_ready(second, 6)
    assert served(second, ds) == sources(ds)
    assert second.status.field("files_reused") == 5
    second.close()
    assert not stage.exists()


# ------------------------------------------------------------- 3: shared stage dirs


def test_two_sessions_on_one_stage_dir_with_different_data_get_their_own_bytes(tmp_path):
    a = make_tree(tmp_path / "a", 12, 500, seed=1)
    b = make_tree(tmp_path / "b", 12, 500, seed=2)  # the same relative names, other bytes
    stage = tmp_path / "stage"
    sa = start_session(a, stage)
    sb = start_session(b, stage)
    wait_ready(sa, 12)
    wait_ready(sb, 12)
    assert served(sa, a) == sources(a)
    assert served(sb, b) == sources(b)
    sb.close()  # the first one out leaves the other's files and metadata alone
    assert served(sa, a) == sources(a)
    assert sa.epoch_stats()["stager_alive"]
    sa.close()  # the last one out cleans up
    assert not stage.exists()
    assert snapshot(a.root) and snapshot(b.root)


def test_two_sessions_with_the_same_data_share_copies_and_the_last_cleans_up(tmp_path):
    ds = make_tree(tmp_path / "a", 10, 500)
    stage = tmp_path / "stage"
    sa = start_session(ds, stage)
    wait_ready(sa, 10)
    sb = start_session(ds, stage)
    wait_ready(sb, 10)
    assert sb.status.field("files_reused") == 10
    sa.close()
    assert served(sb, ds) == sources(ds)
    assert sb.epoch_stats()["hits"] == 10
    sb.close()
    assert not stage.exists()


def test_two_training_jobs_at_once_on_one_stage_dir_match_their_unstaged_runs(tmp_path):
    rng = np.random.default_rng(0)
    from hpcdl.data.convert import write_dataset

    roots = []
    for name in ("x", "y"):  # different data under the same shard names
        images = rng.integers(0, 256, (256, 8, 8, 1), dtype=np.uint8)
        labels = rng.integers(0, 4, 256).astype(np.int64)
        write_dataset(tmp_path / name, {"train": (images, labels)}, list("abcd"), shard_size=32)
        roots.append(tmp_path / name / "train")
    common = ["--model", "mlp", "--epochs", 2, "--batch-size", 16, "--workers", 0, "--quiet"]
    stage = tmp_path / "stage"
    jobs = [
        subprocess.Popen(
            train_cmd(1, "--data", root, *common, "--checkpoint-dir", tmp_path / f"s{i}")
            + ["--stage-dir", str(stage)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=mpi_env(),
        )
        for i, root in enumerate(roots)
    ]
    for job in jobs:
        out, err = job.communicate(timeout=300)
        assert job.returncode == 0, out + err
    for i, root in enumerate(roots):
        plain = run_train(1, "--data", root, *common, "--checkpoint-dir", tmp_path / f"p{i}")
        assert plain.returncode == 0, plain.stderr
        staged = checkpoint.load(checkpoint.latest(tmp_path / f"s{i}")).params
        np.testing.assert_array_equal(
            checkpoint.load(checkpoint.latest(tmp_path / f"p{i}")).params, staged
        )
    assert not stage.exists()


# ------------------------------------------------------------- 7: the stager trusts no plan


def _plan(files: int, entries: list[str]) -> str:
    head = ["hpcdl-plan 1", "fingerprint 00000000000000aa", "seed 0", "epochs 0 1"]
    head += ["steps_per_epoch 1", "local_ranks 1", f"dataset_files {files}"]
    return "\n".join(head + [f"entries {len(entries)}", *entries, "end", ""])


@pytest.mark.parametrize(
    "files, file_id",
    [(2**64 - 1, 100), (2**64 - 1, 70_000), (2**63, 5_000), (10, 10)],
)
def test_a_plan_with_impossible_sizes_is_refused_without_a_crash(tmp_path, files, file_id):
    src = tmp_path / "src.bin"
    src.write_bytes(b"x" * 10)
    plan = _plan(files, [f"{file_id}\t10\t0\tsrc.bin\t{src}"])
    (tmp_path / "plan").write_text(plan)
    proc = subprocess.run(
        [str(find_stager_binary()), "--check-plan", str(tmp_path / "plan")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.startswith("hpcdl-stage: error: plan "), proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr


# ------------------------------------------------------------- unusable stage dirs: one line


@pytest.mark.parametrize("case", ["proc", "hpcdl-symlink", "file"])
def test_an_unusable_stage_dir_is_one_line_and_exit_2(digits_dir, tmp_path, case):
    outside = tmp_path / "outside"
    outside.mkdir()
    if case == "proc":
        stage = Path("/proc/hpcdl-no-such-dir")
    elif case == "hpcdl-symlink":
        stage = tmp_path / "stage"
        stage.mkdir()
        (stage / ".hpcdl").symlink_to(outside, target_is_directory=True)
    else:
        stage = tmp_path / "a-file"
        stage.write_text("mine")
    proc = run_train(
        2,
        *("--data", digits_dir / "train", "--model", "mlp", "--epochs", 1),
        *("--stage-dir", stage),
        timeout=120,
    )
    assert str(stage) in assert_one_error_line(proc, "hpcdl.train: error: cannot use --stage-dir")
    if case != "proc":  # seen without creating anything: said before the start line
        assert "rank(s) on" not in proc.stdout, proc.stdout
    assert list(outside.iterdir()) == []
    if case == "file":
        assert stage.read_text() == "mine"


def test_stage_only_into_an_unusable_dir_is_one_line_and_exit_2(tmp_path):
    ds = make_tree(tmp_path / "pfs", 4, 100)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "hpcdl.stage",
            "--data",
            ds.root,
            "--files-only",
            "--batch-size",
            "1",
        ]
        + ["--stage-dir", "/proc/hpcdl-no-such-dir"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hpcdl.stage: error: cannot use --stage-dir")


@pytest.mark.parametrize("binary", ["/usr/bin/false", "missing"])
def test_a_stager_binary_that_is_not_hpcdl_stage_is_one_line_and_creates_nothing(
    digits_dir, tmp_path, binary
):
    stage = tmp_path / "stage"
    path = binary if binary != "missing" else str(tmp_path / "no-such-hpcdl-stage")
    env = {**mpi_env(), "HPCDL_STAGE_BIN": path}
    proc = run_train(
        2,
        *("--data", digits_dir / "train", "--model", "mlp", "--epochs", 1),
        *("--stage-dir", stage),
        env=env,
        timeout=120,
    )
    line = assert_one_error_line(proc, "hpcdl.train: error: ")
    assert path in line and "HPCDL_STAGE_BIN" in line, line
    assert "Traceback" not in proc.stderr
    assert not stage.exists()  # nothing was created for a job that could not stage
