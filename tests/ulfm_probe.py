"""Test-only MPI program (tests/test_node_loss.py): what Open MPI's fault tolerance (ULFM,
`mpirun --with-ft ulfm`) gives a job that loses ranks or a node. Each rank allreduces 1.0
every 10 ms with MPI.ERRORS_RETURN on a copy of COMM_WORLD. When a collective fails, the rank
revokes the communicator, shrinks it to the survivors, checks an allreduce on them and prints
one line: `shrunk R: N ranks, sum S, T s` (T: from the failed call's start to the shrunk
allreduce's end), then the survivors leave together. argv[1]: a directory for the ranks' pids,
written after 20 allreduces."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD.Dup()
comm.Set_errhandler(MPI.ERRORS_RETURN)
one, total = np.ones(1), np.zeros(1)
for done in range(sys.maxsize):
    if done == 20:  # the job is up on every node: the test may kill now
        Path(sys.argv[1], f"rank-{comm.rank}.pid").write_text(str(os.getpid()))
    started = time.perf_counter()
    try:
        comm.Allreduce(one, total)
    except MPI.Exception as exc:
        assert exc.Get_error_class() in (MPI.ERR_PROC_FAILED, MPI.ERR_REVOKED), exc
        comm.Revoke()
        survivors = comm.Shrink()
        survivors.Allreduce(one, total)
        seconds = time.perf_counter() - started
        print(f"shrunk {comm.rank}: {survivors.size} ranks, sum {total[0]:.0f}, {seconds:.2f} s",
              flush=True)  # fmt: skip
        survivors.Barrier()
        sys.exit(0)
    time.sleep(0.01)
