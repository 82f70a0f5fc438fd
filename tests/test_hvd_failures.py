"""No hang: a rank that leaves (its script ends, or it calls hvd.shutdown()) while another waits
in a collective makes that collective fail on the waiting rank with one line naming the rank,
within seconds; a rank whose collective never gets a partner is not the case here (that waits,
as Horovod does). Real Open MPI under mpirun, 2 ranks."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest
from helpers import mpi_env, mpirun_cmd

pytest.importorskip("torch")

SCRIPT = """
import sys, time, torch
import hpcdl.torch as hvd
hvd.init()
if hvd.rank() == 1:
    {leave}
try:
    hvd.allreduce(torch.ones(3), name="never")
except hvd.HorovodInternalError as exc:
    print("rank 0 error:", exc, flush=True)
    sys.exit(3)
"""


@pytest.mark.parametrize("leave", ["sys.exit(0)", "hvd.shutdown(); time.sleep(1)"])
def test_a_rank_that_leaves_ends_the_others_waiting_collective(tmp_path, leave):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(SCRIPT.format(leave=leave)))
    start = time.monotonic()
    done = subprocess.run(
        [*mpirun_cmd(2), sys.executable, str(script)],
        capture_output=True,
        text=True,
        env=mpi_env(),
        timeout=120,
    )
    assert time.monotonic() - start < 60
    assert "rank 0 error:" in done.stdout, done.stdout + done.stderr
    assert "rank(s) [1] shut down hpcdl.torch" in done.stdout
    assert done.returncode != 0


CRASH = """
import torch
import hpcdl.torch as hvd
hvd.init()
model = torch.nn.Linear(10, 10)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
if hvd.rank() == 1:
    raise RuntimeError("rank 1 fails in its training loop")
model(torch.randn(4, 10)).sum().backward()
opt.step()  # rank 0 waits in its gradient buckets' allreduce
"""


def test_an_exception_on_one_rank_ends_the_job_within_seconds(tmp_path):
    """Without hvd.init()'s abort-on-exception, Open MPI keeps rank 0 in its allreduce and
    rank 1 in MPI_Finalize for ever."""
    script = tmp_path / "crash.py"
    script.write_text(textwrap.dedent(CRASH))
    start = time.monotonic()
    done = subprocess.run(
        [*mpirun_cmd(2), sys.executable, str(script)],
        capture_output=True,
        text=True,
        env=mpi_env(),
        timeout=120,
    )
    assert time.monotonic() - start < 60
    assert done.returncode != 0
    assert "rank 1 fails in its training loop" in done.stderr
    assert done.stderr.count("Traceback") == 1
