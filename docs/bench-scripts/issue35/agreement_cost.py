"""What the trainer's per-step agreements cost on the 4 emulated nodes of `tools.bench
peer-staging` (1 rank per node, the MLP of its jobs, batch 8, 150 Mbit/s links, Open MPI's flat
collectives with yield when idle, as tools.bench.validate runs them). Every rank times, in
windows of 30 steps after 3 warm-up ones, interleaved 8 times:

- plain:     train_step with the gradient reducer, then the 8-byte loss check (calibrate's loop
             before the stop agreement was added to it);
- two:       the same inside the stop agreement (hpcdl.comm.failure.StopAgreement: a 4-byte
             Iallreduce begun before the step, waited for after it): hpcdl.train's loop;
- one:       the loss check and the stop flag in one 8-byte allreduce (MAX of both) after the
             step, no Iallreduce.

Rank 0 prints the slowest rank's mean step per window and the median per variant, in ms.
Needs root (tools.bench.cluster). Usage: agreement_cost.py"""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[2]), str(HERE)]  # the repository root, and _four_nodes

from _four_nodes import job_train_step, print_windows, run_worker, window_s  # noqa: E402

WORKER = "--worker" in sys.argv


def worker() -> None:
    import numpy as np
    from mpi4py import MPI

    from hpcdl.comm.collectives import allreduce_sum
    from hpcdl.comm.failure import StopAgreement

    comm, train, reducer = job_train_step()
    stop = StopAgreement(comm)
    flag, both = np.zeros(1), np.zeros(2)

    def plain() -> None:
        train()
        allreduce_sum(comm, flag)

    def two() -> None:
        stop.start_step()
        train()
        allreduce_sum(comm, flag)
        stop.should_stop()

    def one() -> None:
        train()
        comm.Allreduce(MPI.IN_PLACE, both, op=MPI.MAX)

    variants = {"plain": plain, "two": two, "one": one}
    means: dict[str, list[float]] = {name: [] for name in variants}
    for k in range(8):
        order = list(variants) if k % 2 == 0 else list(reversed(variants))
        for name in order:
            means[name].append(window_s(comm, variants[name]))
    stop.close()
    reducer.close()
    if comm.rank == 0:
        print_windows(means)


if __name__ == "__main__":
    worker() if WORKER else run_worker(__file__)
