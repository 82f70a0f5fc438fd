"""SyncBatchNorm (`Model.set_stat_reducer`, `--sync-bn`): R ranks of batch B equal 1 rank of R*B.

Three levels: two "ranks" as threads in one process (the algebra, on numpy and cupy), two MPI
ranks summing through hpcdl.comm (`mpirun -np 2 python -m pytest --with-mpi`), and one short
trainer run with the flags wired.

Tolerance: float64, parameters after 4 SGD-momentum steps of resnet20 agree to 1e-10 relative
(measured ~1e-14: the two computations differ only in summation order and in the shifted
sum-of-squares variance); without SyncBatchNorm they differ by more than 1e-3.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from hpcdl import nn
from hpcdl.backend import to_host

SHAPE, CLASSES, B, RANKS, STEPS = (3, 8, 8), 10, 4, 2, 4
RTOL = 1e-10


def global_batch(step, xp=np, ranks=RANKS):
    rng = np.random.default_rng(step)
    x = rng.standard_normal((ranks * B, *SHAPE)) * 2.0 + 0.5  # a non-zero mean to normalise
    return xp.asarray(x), xp.asarray(rng.integers(0, CLASSES, ranks * B))


def resnet(xp):
    return nn.build_model("resnet20", SHAPE, CLASSES, seed=5, xp=xp, dtype=np.float64)


def sgd(model):
    return nn.make_optimizer("sgd", model.params, model.grads, momentum=0.9)


def train_step(model, x, y, scale=1.0):
    """Forward and backward; dlogits scaled so that the ranks' gradients sum to the mean."""
    _, d = nn.softmax_cross_entropy(model.forward(x, train=True), y)
    model.backward(d * scale)


def one_rank_reference(xp, ranks=RANKS):
    model = resnet(xp)
    opt = sgd(model)
    for step in range(STEPS):
        train_step(model, *global_batch(step, xp, ranks))
        opt.step(0.1)
    return to_host(model.params), to_host(model.buffers)


class ThreadSum:
    """Sums a buffer over `n` threads in place, the same order on each: an allreduce stand-in."""

    def __init__(self, n: int) -> None:
        self.barrier = threading.Barrier(n, timeout=60)
        self.slots: list = [None] * n
        self.calls = 0

    def reducer(self, rank: int):
        def reduce(buf) -> None:
            self.slots[rank] = buf.copy()
            self.barrier.wait()
            total = sum(self.slots[1:], self.slots[0].copy())
            self.barrier.wait()  # nobody overwrites a slot before everyone has read it
            buf[...] = total
            self.calls += rank == 0

        return reduce


def threaded_ranks(xp, sync: bool):
    """RANKS models in RANKS threads, each on its slice of the global batch; gradients averaged."""
    models = [resnet(xp) for _ in range(RANKS)]
    opts = [sgd(m) for m in models]
    summer = ThreadSum(RANKS)
    if sync:
        for rank, model in enumerate(models):
            model.set_stat_reducer(summer.reducer(rank))
    errors: list = []
    for step in range(STEPS):
        x, y = global_batch(step, xp)

        def run(rank, x=x, y=y):
            try:
                part = slice(rank * B, (rank + 1) * B)
                train_step(models[rank], x[part], y[part], scale=1.0 / RANKS)
            except BaseException as exc:  # noqa: BLE001 -- reported below, in the test's thread
                errors.append(exc)
                summer.barrier.abort()

        threads = [threading.Thread(target=run, args=(r,)) for r in range(RANKS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        total = sum(m.grads for m in models)  # the gradient allreduce (losses prescaled)
        for model, opt in zip(models, opts):
            model.grads[...] = total
            opt.step(0.1)
    return models, summer.calls


def max_rel_diff(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_sync_bn_in_threads_matches_one_rank_with_the_joined_batch(xp):
    ref_params, ref_buffers = one_rank_reference(xp)
    models, calls = threaded_ranks(xp, sync=True)
    # 19 BatchNorms, each one reduction in forward and one in backward (resnet20 starts with a
    # convolution, so every BatchNorm computes its input gradient).
    assert calls == STEPS * 19 * 2
    for model in models:
        assert max_rel_diff(to_host(model.params), ref_params) < RTOL
        # running statistics come from the global batch too, identical on every rank
        assert max_rel_diff(to_host(model.buffers), ref_buffers) < RTOL


def test_without_sync_bn_the_ranks_normalise_with_their_own_statistics():
    ref_params, _ = one_rank_reference(np)
    models, calls = threaded_ranks(np, sync=False)
    assert calls == 0
    assert max_rel_diff(models[0].params, ref_params) > 1e-3


def test_eval_mode_does_not_reduce_and_a_none_reducer_restores_local_statistics():
    model = resnet(np)
    seen = []
    model.set_stat_reducer(seen.append)
    x, y = global_batch(0)
    model.forward(x, train=False)
    assert seen == []
    model.set_stat_reducer(None)
    train_step(model, x, y)
    assert seen == []


@pytest.mark.mpi(min_size=2)
def test_two_mpi_ranks_with_sync_bn_match_one_rank_with_batch_2b():
    from mpi4py import MPI

    from hpcdl.comm.collectives import SumReducer
    from hpcdl.comm.reducer import GradientReducer

    comm = MPI.COMM_WORLD
    size, rank = comm.Get_size(), comm.Get_rank()
    ref_params, ref_buffers = one_rank_reference(np, ranks=size)
    outcomes = []
    for sync in (True, False):
        model = resnet(np)
        opt = sgd(model)
        stats = SumReducer(comm) if sync else None
        model.set_stat_reducer(stats)
        grads = GradientReducer(comm, model.grads, bucket_mb=0.05, prescaled=True)
        try:
            for step in range(STEPS):
                x, y = global_batch(step, ranks=size)
                mine = slice(rank * B, (rank + 1) * B)
                grads.begin_step()
                _, d = nn.softmax_cross_entropy(model.forward(x[mine], train=True), y[mine])
                model.backward(d / size, grad_ready=grads.mark_ready)
                grads.wait()
                opt.step(0.1)
        finally:
            grads.close()
            if stats:
                stats.close()
        outcomes.append(
            (max_rel_diff(model.params, ref_params), max_rel_diff(model.buffers, ref_buffers))
        )
    outcomes = comm.allgather(outcomes)  # every rank asserts on every rank's outcome
    for (synced, synced_buffers), (local, _) in outcomes:
        assert synced < RTOL and synced_buffers < RTOL, outcomes
        assert local > 1e-3, outcomes


def test_trainer_runs_resnet20_with_sync_bn_adamw_and_no_decay_bias_norm(digits_dir, tmp_path):
    """One short 2-rank run: the flags are wired, and the ranks stay identical."""
    from helpers import read_events, run_train

    metrics = tmp_path / "m.jsonl"
    proc = run_train(
        2,
        *("--data", digits_dir / "train", "--model", "resnet20", "--batch-size", 8),
        *("--optimizer", "adamw", "--lr", 0.001, "--weight-decay", 0.01),
        *("--sync-bn", "--no-decay-bias-norm", "--max-steps", 3, "--workers", 0),
        *("--metrics", metrics),
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = read_events(metrics, "start")[0]["config"]
    assert '"sync_bn": true' in config and '"decay_bias_norm": false' in config
    assert read_events(metrics, "summary")[0]["steps"] == 3
