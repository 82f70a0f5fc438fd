"""What the tests of lost ranks share (tests/test_on_node_loss.py, tests/test_node_loss.py): the
probe model's environment, waiting for a rank's Nth training step while its job runs, and
killing processes outright. No test module imports another."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from helpers import mpi_env, wait_until


def probe_env(record: Path, slow: str = "", **more: str) -> dict[str, str]:
    """The job's environment for tests/probe_model.py: its record in `record` (created here),
    HPCDL_PROBE_SLOW=slow, and any other variables given; HPCDL_TEST_MARKER is `record`, so
    helpers.rank_pid(str(record), rank) finds the job's ranks."""
    record.mkdir()
    return {**mpi_env(), "HPCDL_PROBE_RECORD": str(record), "HPCDL_PROBE_SLOW": slow,
            "HPCDL_TEST_MARKER": str(record), **more}  # fmt: skip


def wait_for_step(job: subprocess.Popen, record: Path, rank: int, steps: int) -> None:
    """Wait (120 s at most) until rank `rank` (its OMPI_COMM_WORLD_RANK) has recorded `steps`
    training steps in the probe's record dir; the job must not end before."""
    path = Path(record) / f"rank-{rank}.txt"

    def reached() -> bool:
        assert job.poll() is None, job.communicate()
        return path.exists() and len(path.read_text().splitlines()) >= steps

    wait_until(reached, 120, f"rank {rank}'s step {steps}")


def kill(pid: int) -> bool:
    """SIGKILL pid; False when it was already gone."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def is_rank(pid: int) -> bool:
    """An MPI rank of hpcdl.train (not its loader workers or stager, which have no rank)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    named = any(e.startswith(b"OMPI_COMM_WORLD_RANK=") for e in environ)
    return named and b"hpcdl.train" in cmdline
