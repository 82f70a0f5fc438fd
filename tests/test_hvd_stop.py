"""hpcdl.torch.stop_requested(): False until SIGUSR1 (the time-limit signal of hpcdl's Slurm
scripts) arrives, then True; under mpirun after hvd.init(), True on every rank when only one
rank got the signal, so all of them checkpoint and exit 0 together. Real processes, signals
and Open MPI."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from helpers import mpi_env, mpirun_cmd

pytest.importorskip("torch")

ALONE = """
import os, signal
import hpcdl.torch as hvd
assert not hvd.stop_requested()
assert signal.getsignal(signal.SIGUSR1) is not signal.SIG_DFL  # installed by the first call
os.kill(os.getpid(), signal.SIGUSR1)
print("stop", hvd.stop_requested())
"""

RANKS = """
import os, signal
import hpcdl.torch as hvd
hvd.init()
for step in range(1000):
    if step == 3 and hvd.rank() == 1:
        os.kill(os.getpid(), signal.SIGUSR1)  # only rank 1 gets it
    if hvd.stop_requested():
        print(f"rank {hvd.rank()} stops at step {step}", flush=True)
        break
"""


def run(cmd: list[str], tmp_path, source: str) -> subprocess.CompletedProcess:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(source))
    return subprocess.run(
        [*cmd, str(script)], capture_output=True, text=True, env=mpi_env(), timeout=120
    )


def test_alone_the_signal_turns_it_true(tmp_path):
    done = run([sys.executable], tmp_path, ALONE)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "stop True"


def test_under_mpirun_every_rank_stops_at_the_same_step(tmp_path):
    done = run([*mpirun_cmd(2), sys.executable], tmp_path, RANKS)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.strip().splitlines()) == [
        "rank 0 stops at step 3",
        "rank 1 stops at step 3",
    ]
