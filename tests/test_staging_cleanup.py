"""The job ends when training ends (issue 29): the last job out renames its copies away and
leaves; a separate process removes them, and the next job on the node finishes what a killed
remover left. Asserts on files, not on time (NOTE [clean-up off the job's path])."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcdl.stage import main as stage_main
from hpcdl.staging import trash
from hpcdl.staging.ownership import StageDirLease, data_key


def make_files(root: Path, n: int, per_dir: int = 1000) -> None:
    for i in range(n):
        d = root / f"d{i // per_dir:03d}"
        if i % per_dir == 0:
            d.mkdir(parents=True)
        fd = os.open(d / f"f{i:06d}.bin", os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, b"x" * (1 + i % 5))
        os.close(fd)


def stage_all(data: Path, stage: Path) -> None:
    """A stage-only run: copies every file of data into stage and keeps them."""
    argv = ["--data", str(data), "--files-only", "--stage-dir", str(stage), "--quiet"]
    argv += ["--batch-size", "1"]
    assert stage_main(argv) == 0


def count_files(root: Path) -> int:
    return sum(len(files) for _, _, files in os.walk(root))


def wait_until(predicate, timeout: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)
    return predicate()


def test_release_hands_20000_copies_off_and_the_next_job_finishes_a_killed_removal(
    tmp_path, monkeypatch
):
    data, stage = tmp_path / "data", tmp_path / "stage"
    make_files(data, 20_000)
    stage_all(data, stage)
    key = data_key(data)
    assert count_files(stage / key) == 20_000
    handed = []
    monkeypatch.setattr(trash, "start_remover", handed.append)  # a remover killed at once
    StageDirLease.acquire(stage).release(keep=False)
    assert handed == [stage.resolve()]
    assert sorted(os.listdir(stage)) == [".hpcdl"]  # the copies left the stage dir's namespace
    [entry] = list((stage / ".hpcdl" / "trash").iterdir())
    assert count_files(entry / "tree") == 20_000  # and the job removed none of them itself
    monkeypatch.undo()

    lease = StageDirLease.acquire(stage)  # the next job: the entry is unclaimed, a remover starts
    assert wait_until(lambda: not entry.exists())
    left = {str(Path(d, f).relative_to(stage)) for d, _, fs in os.walk(stage) for f in fs}
    own = {".hpcdl/lock", ".hpcdl/created", f".hpcdl/sessions/{lease.session}/owner"}
    assert left == own  # only the new job's own files
    lease.release(keep=False)
    assert not stage.exists()


def test_a_large_release_returns_before_the_removal_and_nothing_is_left(tmp_path):
    data, stage = tmp_path / "data", tmp_path / "stage"
    make_files(data, 5000)
    stage_all(data, stage)
    assert (stage / ".hpcdl" / "manifest").stat().st_size > trash.INLINE_MANIFEST_BYTES
    StageDirLease.acquire(stage).release(keep=False)
    assert not (stage / data_key(data)).exists()
    assert wait_until(lambda: not stage.exists())  # the detached remover, then its tidy-up
    assert count_files(data) == 5000  # the data set untouched


def test_the_removal_keeps_what_is_not_hpcdls_and_never_follows_a_symlink(tmp_path):
    data, stage, mine = tmp_path / "data", tmp_path / "stage", tmp_path / "mine"
    make_files(data, 30)
    make_files(mine, 3)
    stage_all(data, stage)
    key = data_key(data)
    (stage / key / "d000" / "notes.txt").write_text("a user's file")
    os.symlink(mine, stage / key / "d000" / "link")
    (stage / "other").mkdir()
    StageDirLease.acquire(stage).release(keep=False)
    left = [Path(d) / f for d, _, fs in os.walk(stage) for f in fs]
    notes = stage / key / "d000" / "notes.txt"  # put back where it was
    assert left == [notes] and notes.read_text() == "a user's file"
    assert (stage / key / "d000" / "link").is_symlink() and count_files(mine) == 3
    assert (stage / "other").is_dir() and not (stage / ".hpcdl").exists()


def test_keep_staged_moves_nothing(tmp_path):
    data, stage = tmp_path / "data", tmp_path / "stage"
    make_files(data, 20)
    stage_all(data, stage)
    StageDirLease.acquire(stage).release(keep=True)
    assert count_files(stage / data_key(data)) == 20
    assert not (stage / ".hpcdl" / "trash").exists()


def _waiting_on_flock(timeout: float = 10.0) -> bool:
    """True once a thread of this process waits for an flock: a '->' line in /proc/locks with
    this pid ("1: -> FLOCK ADVISORY WRITE PID ..."), not another test's process beside it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = Path("/proc/locks").read_text().splitlines()
        waits = [line.split()[1:] for line in lines if "->" in line.split()[1:2]]
        if any(w[1] == "FLOCK" and w[4] == str(os.getpid()) for w in waits if len(w) > 4):
            return True
        time.sleep(0.01)
    return False


def test_a_tidy_that_waited_on_the_lock_while_another_tidied_leaves_no_stage_dir(tmp_path):
    """The CI flake of 2026-11-26: a remover's last tidy waited on the lock while the releasing
    job's tidy removed the lock, hpcdl's metadata and the stage dir; on waking it recreated
    .hpcdl and its lock, so the job's rmdir of the stage dir failed and an empty stage dir
    that hpcdl created stayed behind; woken after the stage dir was gone, it raised (in a
    releasing job: at its exit)."""
    import threading

    from hpcdl.staging.layout import StageDir, locked, tidy_if_unused

    stage = tmp_path / "stage"
    StageDirLease.acquire(stage).release(keep=True)  # hpcdl's metadata, no live session
    layout = StageDir(stage)
    raised = []

    def tidy() -> None:
        try:
            tidy_if_unused(stage)
        except OSError as exc:
            raised.append(exc)

    waiter = threading.Thread(target=tidy)
    with locked(stage):
        waiter.start()
        assert _waiting_on_flock()
        # What the winning tidy does while it holds the lock and right after it:
        # everything of hpcdl's goes, the stage dir too.
        tidy_under_lock = [layout.sessions / s for s in os.listdir(layout.sessions)]
        for session in tidy_under_lock:
            for f in os.listdir(session):
                os.unlink(session / f)
            os.rmdir(session)
        os.rmdir(layout.sessions)
        os.unlink(layout.created)
        os.unlink(layout.lock)
        os.rmdir(layout.meta)
        os.rmdir(stage)
    waiter.join(timeout=30)
    assert not waiter.is_alive()
    assert raised == []
    assert not stage.exists()  # the waiter found the lock gone: nothing left for it to tidy


def test_the_remover_starts_on_the_standard_library_alone(tmp_path):
    """The detached remover runs while the job's processes end, on the same cores: it imports
    what removing needs (os, fcntl: hpcdl.staging.trash, layout, manifest), not the staging
    session, the data sets or NumPy, which cost half a second of CPU before the first unlink,
    and is not imported twice (runpy's warning when the package imports it first)."""
    probe = (
        "import runpy, sys; sys.argv = ['trash', sys.argv[1]]\n"
        "try:\n    runpy.run_module('hpcdl.staging.trash', run_name='__main__')\n"
        "except SystemExit as e:\n    assert e.code == 0, e.code\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith(('hpcdl', 'numpy')))))"
    )
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", probe, str(tmp_path / "no-stage")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    loaded = set(done.stdout.split())
    assert {"hpcdl.staging.layout", "hpcdl.staging.manifest"} <= loaded  # the remover's own
    assert not {m for m in loaded if m.startswith("numpy")}, loaded
    assert not loaded & {"hpcdl.staging.session", "hpcdl.data", "hpcdl.config"}, loaded


def test_every_name_the_staging_package_lists_is_there():
    """hpcdl.staging imports its names when asked (the remover above); each one it lists must
    resolve, to the object its module defines."""
    import hpcdl.staging  # noqa: PLC0415
    from hpcdl.staging import session  # noqa: PLC0415

    assert len(hpcdl.staging.__all__) == 18
    for name in hpcdl.staging.__all__:
        assert getattr(hpcdl.staging, name) is not None, name
    assert hpcdl.staging.StagingSession is session.StagingSession
    with pytest.raises(AttributeError, match="no_such_name"):
        hpcdl.staging.no_such_name  # noqa: B018
