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

from _four_nodes import job_train_step, print_windows, run_worker, window_s  # noqa: E402


def worker() -> None:
    import os
    import secrets
    import signal

    import numpy as np

    from hpcdl.bench.calibrate_contention import renice
    from hpcdl.bench.calibrate_peer import start_stager, wait_ready, write_plan
    from hpcdl.comm.collectives import allreduce_sum
    from hpcdl.staging.peer_tier import open_listener
    from hpcdl.staging.plan import FileTreeDataset

    comm, train, reducer = job_train_step()
    flag = np.zeros(1)

    def step() -> None:
        train()
        allreduce_sum(comm, flag)  # the loss check

    with tempfile.TemporaryDirectory(prefix=f"hpcdl-idle-server-{comm.rank}-") as tmp:
        root = Path(tmp)
        (root / "pfs").mkdir()
        for i in range(64):
            (root / "pfs" / f"f{i:03d}").write_bytes(os.urandom(3000))
        ds = FileTreeDataset(root / "pfs")
        listener, why = open_listener()
        assert listener is not None, why
        write_plan(ds, root / "home", 0, None)
        home = start_stager(root / "home", secrets.token_hex(32), [], listener, 8)
        listener.close()
        try:
            wait_ready(root / "home", home, 64)
            renice(home.pid, 10)
            means: dict[str, list[float]] = {"serving": [], "stopped": []}
            for k in range(16):
                name = "serving" if k % 2 == 0 else "stopped"
                home.send_signal(signal.SIGCONT if name == "serving" else signal.SIGSTOP)
                comm.Barrier()
                means[name].append(window_s(comm, step))
        finally:  # never leave it stopped
            home.send_signal(signal.SIGCONT)
            home.send_signal(signal.SIGUSR1)
            home.wait(60)
    reducer.close()
    if comm.rank == 0:
        print_windows(means)


if __name__ == "__main__":
    worker() if "--worker" in sys.argv else run_worker(__file__)
