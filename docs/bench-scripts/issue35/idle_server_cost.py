"""What an idle peer server costs the steps on the 4 emulated nodes of `tools.bench
peer-staging` (1 rank per node, the MLP of its jobs, batch 8, flat collectives with yield when
idle, as tools.bench.validate runs them). Every rank starts a real hpcdl-stage that stages 64
small files as its node's home and serves them on the node's address, then goes 10 steps nicer,
as a job's stager is in a later epoch with nothing left to fetch (the last epoch). The ranks then
time train_step + the loss check in windows of 30 steps after 3 warm-up ones, 8 times over,
with the stager running (idle: serving nobody) or stopped (SIGSTOP) in turn. Rank 0 prints the
slowest rank's mean step per window and the median of each, in ms. Needs root
(tools.bench.cluster). Usage: idle_server_cost.py"""

import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[2]), str(HERE)]  # the repository root, and _four_nodes

from _four_nodes import print_windows, run_worker  # noqa: E402


def worker() -> None:
    import os
    import secrets
    import signal
    import time
    from dataclasses import replace
    from types import SimpleNamespace

    import numpy as np
    from mpi4py import MPI

    from hpcdl.bench.calibrate_contention import renice
    from hpcdl.bench.calibrate_peer import start_stager, wait_ready, write_plan
    from hpcdl.bench.compute_setup import hpcdl_setup
    from hpcdl.comm import blas_threads
    from hpcdl.comm.collectives import allreduce_sum
    from hpcdl.comm.reducer import GradientReducer
    from hpcdl.comm.world import init_world
    from hpcdl.nn.step import train_step
    from hpcdl.staging.peer_tier import open_listener
    from hpcdl.staging.plan import FileTreeDataset

    world = init_world()
    blas_threads.set_for_rank(world.node_comm)
    comm = world.comm
    with tempfile.TemporaryDirectory(prefix=f"hpcdl-idle-server-{comm.rank}-") as tmp:
        root = Path(tmp)
        for i in range(64):
            (root / "pfs").mkdir(exist_ok=True)
            (root / "pfs" / f"f{i:03d}").write_bytes(os.urandom(3000))
        ds = FileTreeDataset(root / "pfs")
        listener, why = open_listener()
        assert listener is not None, why
        write_plan(ds, root / "home", 0, None)
        home = start_stager(root / "home", secrets.token_hex(32), [], listener, 8)
        listener.close()
        wait_ready(root / "home", home, 64)
        renice(home.pid, 10)
        spec = SimpleNamespace(model="mlp", shape=(3, 32, 32), classes=4, device="cpu",
                               precision="fp32", batch_size=8)  # fmt: skip
        parts, x, y = hpcdl_setup(spec)
        reducer = GradientReducer(comm, parts.model.grads, 25.0, prescaled=True)
        parts = replace(parts, reducer=reducer)
        flag = np.zeros(1)
        means: dict[str, list[float]] = {"serving": [], "stopped": []}
        for k in range(16):
            name = "serving" if k % 2 == 0 else "stopped"
            home.send_signal(signal.SIGCONT if name == "serving" else signal.SIGSTOP)
            comm.Barrier()
            times = []
            for i in range(33):
                t0 = time.perf_counter()
                train_step(parts, x, y, 0.01)
                allreduce_sum(comm, flag)
                if i >= 3:
                    times.append(time.perf_counter() - t0)
            means[name].append(comm.allreduce(float(np.mean(times)), op=MPI.MAX))
        home.send_signal(signal.SIGCONT)
        home.send_signal(signal.SIGUSR1)
        home.wait(60)
        reducer.close()
    if comm.rank == 0:
        print_windows(means)


if __name__ == "__main__":
    worker() if "--worker" in sys.argv else run_worker(__file__)
