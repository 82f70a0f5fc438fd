"""Loader workers never die of a stop signal meant for the training process, not even one that
comes while a worker is still starting (its interpreter and imports, before it could ignore
anything): mpirun passes SIGUSR1 to a rank's whole process group, Slurm's scancel and time limit
send SIGTERM to every process of the job (NOTE [stop signals] in hpcdl/stop_signals.py)."""

from __future__ import annotations

import os
import signal

import numpy as np
from helpers import wait_until

from hpcdl.data import Loader, open_dataset
from hpcdl.data.sampler import DistributedSampler

STOPS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)


def signal_set(pid: int, field: str) -> set[int]:
    """The signals in /proc/PID/status's mask `field` (SigIgn, SigBlk, ...)."""
    with open(f"/proc/{pid}/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    bits = int(line.split()[1], 16)
    return {n + 1 for n in range(64) if bits >> n & 1}


def batches(loader: Loader, order: list) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(x.copy(), y.copy()) for x, y in loader.iterate(order, 0, train=True)]


def test_a_stop_signal_while_the_workers_start_kills_none_of_them(digits_dir):
    ds = open_dataset(digits_dir / "train")
    order = DistributedSampler(len(ds), 1, 0, seed=3).batches(0, 16)[:6]
    with Loader(ds, 16, workers=0, seed=3) as inline:
        want = batches(inline, order)
    with Loader(ds, 16, workers=2, seed=3) as loader:
        pids = loader.worker_pids
        # still starting: no worker has come as far as ignoring the stop signals itself
        starting = [pid for pid in pids if not set(STOPS) <= signal_set(pid, "SigIgn")]
        for pid in pids:
            for sig in STOPS:
                os.kill(pid, sig)
        got = batches(loader, order)
        assert starting, "every worker had started already: the test saw no start-up"
        for pid in pids:  # alive, and now ignoring them, unblocked again
            assert set(STOPS) <= signal_set(pid, "SigIgn"), pid
            assert not set(STOPS) & signal_set(pid, "SigBlk"), pid
    assert len(got) == len(want)
    for (x, y), (wx, wy) in zip(got, want):
        np.testing.assert_array_equal(x, wx)
        np.testing.assert_array_equal(y, wy)


def test_the_training_process_gets_a_stop_that_came_while_it_started_workers(digits_dir):
    """The stop signals are blocked in the starting thread only while a worker is made."""
    ds = open_dataset(digits_dir / "train")
    caught: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, _frame: caught.append(signum))
    try:
        with Loader(ds, 16, workers=2, seed=3):
            assert not set(STOPS) & signal_set(os.getpid(), "SigBlk")
            os.kill(os.getpid(), signal.SIGUSR1)
            wait_until(lambda: caught, 10, "the handler of this process")
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert caught == [signal.SIGUSR1]
