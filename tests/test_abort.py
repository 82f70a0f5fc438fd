"""An exception on one rank ends the whole job with one message naming the rank (no hang)."""

import subprocess
import sys
import textwrap
import time

from helpers import mpi_env, mpirun_cmd

SCRIPT = textwrap.dedent(
    """
    import time
    from mpi4py import MPI
    from hpcdl.comm.failure import install_abort_on_exception
    comm = MPI.COMM_WORLD
    install_abort_on_exception(comm, comm.rank)
    if comm.rank == 1:
        time.sleep(0.5)
        raise RuntimeError("disk on fire")
    comm.Barrier()  # rank 0 would wait here forever without the abort
    """
)


def test_exception_on_one_rank_aborts_the_job_quickly(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(SCRIPT)
    start = time.monotonic()
    proc = subprocess.run(
        [*mpirun_cmd(2), sys.executable, str(script)],
        capture_output=True,
        text=True,
        env=mpi_env(),
        timeout=60,
    )
    assert proc.returncode != 0
    assert time.monotonic() - start < 30
    assert proc.stderr.count("hpcdl: rank 1 failed") == 1
    assert "RuntimeError: disk on fire" in proc.stderr
