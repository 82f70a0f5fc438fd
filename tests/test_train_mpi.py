"""Data-parallel invariants, checked inside a 2-rank MPI job (pytest --with-mpi)."""

import os
import signal
import time

import numpy as np
import pytest
from helpers import digest

from hpcdl import nn
from hpcdl.comm.collectives import broadcast
from hpcdl.comm.failure import StopAgreement
from hpcdl.comm.reducer import GradientReducer

SHAPE, CLASSES = (1, 8, 8), 10


def _batch(seed, n):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, *SHAPE)).astype(np.float32)
    y = rng.integers(0, CLASSES, n).astype(np.int64)
    return x, y


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("model_name", ["mlp", "cnn", "resnet20"])
def test_parameters_stay_bitwise_identical_after_every_step(model_name):
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    # Different seeds per rank: the start-up broadcast must make them equal anyway.
    model = nn.build_model(model_name, SHAPE, CLASSES, seed=comm.rank)
    broadcast(comm, model.params)
    broadcast(comm, model.buffers)
    opt = nn.make_optimizer("sgd", model.params, model.grads, momentum=0.9)
    reducer = GradientReducer(comm, model.grads, bucket_mb=0.05)
    try:
        for step in range(4):
            x, y = _batch(1000 * step + comm.rank, 16)  # each rank its own data
            _, dlogits = nn.softmax_cross_entropy(model.forward(x, train=True), y)
            reducer.begin_step()
            model.backward(dlogits, grad_ready=reducer.mark_ready)
            reducer.wait()
            opt.step(0.05)
            digests = comm.allgather(digest(model.params))
            assert len(set(digests)) == 1, f"parameters differ after step {step}"
    finally:
        reducer.close()


@pytest.mark.mpi(min_size=2)
def test_two_ranks_with_batch_b_match_one_rank_with_batch_2b():
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    size, b = comm.size, 8
    # float64: in float32 the rounding differences of the two summation orders (~1e-7) grow
    # through 5 momentum steps to ~1e-3 relative; float64 leaves only the algebra to compare.
    model = nn.build_model("cnn", SHAPE, CLASSES, seed=3, dtype=np.float64)
    reference = nn.build_model("cnn", SHAPE, CLASSES, seed=3, dtype=np.float64)
    opt = nn.make_optimizer("sgd", model.params, model.grads, momentum=0.9)
    ref_opt = nn.make_optimizer("sgd", reference.params, reference.grads, momentum=0.9)
    reducer = GradientReducer(comm, model.grads, bucket_mb=0.01)
    try:
        for step in range(5):
            x, y = _batch(step, b * size)  # the same global batch on every rank
            x = x.astype(np.float64)
            mine = slice(comm.rank * b, (comm.rank + 1) * b)
            # train=False: no dropout randomness, so the two computations are comparable
            _, d = nn.softmax_cross_entropy(model.forward(x[mine], train=False), y[mine])
            reducer.begin_step()
            model.backward(d, grad_ready=reducer.mark_ready)
            reducer.wait()
            opt.step(0.1)
            _, d = nn.softmax_cross_entropy(reference.forward(x, train=False), y)
            reference.backward(d)
            ref_opt.step(0.1)
    finally:
        reducer.close()
    np.testing.assert_allclose(model.params, reference.params, rtol=1e-9, atol=1e-12)
    start = nn.build_model("cnn", SHAPE, CLASSES, seed=3, dtype=np.float64).params
    assert not np.allclose(model.params, start)


@pytest.mark.mpi(min_size=2)
def test_a_signal_on_one_rank_stops_all_ranks_at_the_same_step():
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    stop = StopAgreement(comm)
    try:
        stopped_at = None
        for step in range(20):
            stop.start_step()
            if step == 5 and comm.rank == comm.size - 1:
                os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.01)  # a step's work; the checks below are on what the ranks agreed
            if stop.should_stop():
                stopped_at = step
                break
        assert comm.allgather(stopped_at) == [stopped_at] * comm.size
        assert stopped_at is not None and stopped_at >= 5
        assert stop.signal_name == "SIGUSR1"
    finally:
        stop.close()
