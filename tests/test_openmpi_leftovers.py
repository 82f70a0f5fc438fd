"""Open MPI's session dirs left by a launcher that was killed: the next launcher that draws the
same pid fails to start ("The PMIx server's listener thread failed to start", exit 213;
openpmix/openpmix#4022), so the test session removes them before every test (conftest)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from helpers import mpi_env, mpirun_cmd, remove_stale_session_dirs


def launcher_dir(proc: subprocess.Popen, deadline_s: float = 60) -> Path:
    """The session dir of a running `mpirun` (its launcher's pid), once it exists."""
    tmp = Path(tempfile.gettempdir())
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        found = tmp / f"ompi.{proc.pid}"
        if found.is_dir() and any(found.iterdir()):
            return found
        time.sleep(0.05)
    raise AssertionError(f"mpirun (pid {proc.pid}) made no session dir in {tmp}")


def test_a_killed_launchers_session_dir_goes_and_a_live_ones_stays(tmp_path):
    live = subprocess.Popen([*mpirun_cmd(1), "sleep", "60"], env=mpi_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # fmt: skip
    killed = subprocess.Popen([*mpirun_cmd(1), "sleep", "60"], env=mpi_env(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)  # fmt: skip
    mine = Path("/nonexistent")
    try:
        mine, stale = launcher_dir(live), launcher_dir(killed)
        os.killpg(killed.pid, signal.SIGKILL)  # as a test that kills a job does
        killed.wait(timeout=30)
        assert stale.is_dir()  # Open MPI leaves it behind
        # a dir whose pid now belongs to a process started after the dir was last changed
        newer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        reused = Path(tempfile.gettempdir()) / f"ompi.{newer.pid}"
        reused.mkdir()
        (reused / "pmix.vm.tool").write_text("stale")
        hour_ago = time.time() - 3600
        os.utime(reused / "pmix.vm.tool", (hour_ago, hour_ago))
        os.utime(reused, (hour_ago, hour_ago))
        other = tmp_path / "ompi.notapid"
        try:
            removed = remove_stale_session_dirs(Path(tempfile.gettempdir()))
            assert stale in removed and not stale.exists()
            assert reused in removed and not reused.exists()
            assert mine.is_dir() and mine not in removed  # its launcher still runs
        finally:
            newer.kill()
            newer.wait()
        other.mkdir()
        assert remove_stale_session_dirs(tmp_path) == [] and other.is_dir()  # not Open MPI's
    finally:
        for proc in (live, killed):
            if proc.poll() is None:
                proc.terminate()  # mpirun ends its job and removes its session dir
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
    assert not mine.exists()  # the live launcher, ended normally, removed its own


def test_a_remote_daemons_stale_session_dir_goes_too(tmp_path):
    """prted, the daemon mpirun starts on every other node (an emulated node here), keeps its
    session dir in `prted.<pid>`, left behind when the daemon is killed with its node; a later
    daemon that draws the pid exits 213 in the same way ("daemon failed to report back")."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # its pid runs nothing now
    newer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        hour_ago = time.time() - 3600
        dead, reused = tmp_path / f"prted.{gone.pid}", tmp_path / f"prted.{newer.pid}"
        live = tmp_path / f"prted.{os.getpid()}"  # a daemon that still runs: this process
        for d in (dead, reused, live):
            (d / "jf.0").mkdir(parents=True)
        os.utime(reused, (hour_ago, hour_ago))  # made before its pid's process started
        removed = remove_stale_session_dirs(tmp_path)
        assert sorted(removed) == sorted([dead, reused]), removed
        assert not dead.exists() and not reused.exists() and live.is_dir()
    finally:
        newer.kill()
        newer.wait()
