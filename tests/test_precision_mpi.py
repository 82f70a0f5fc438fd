"""--precision across ranks (`mpirun -np 2 python -m pytest --with-mpi`): an fp16 overflow on
one rank skips the step on every rank, and reduced-precision ranks stay bitwise identical."""

import numpy as np
import pytest

from hpcdl import nn
from hpcdl.nn.precision import LossScaler
from hpcdl.nn.step import StepParts, train_step

pytestmark = pytest.mark.mpi(min_size=2)


def comm_world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def test_any_rank_is_true_everywhere_when_one_rank_says_so():
    from hpcdl.comm.collectives import AnyRank

    comm = comm_world()
    any_rank = AnyRank(comm)
    try:
        seen = [any_rank(comm.rank == 1), any_rank(False), any_rank(True)]
    finally:
        any_rank.close()
    assert comm.allgather(seen) == [[True, False, True]] * comm.size


def ranks_step(
    precision: str,
    scaler_on: bool,
    poison_rank: int | None,
    steps: int,
    reduce: bool = True,
    carry: bool = False,
    on_device: bool = False,
):
    """Steps of cnn on every rank's own batch with the real gradient reducer (reduce=False:
    none, as --sync params:K); poison_rank's first batch holds an inf. carry: the reducer sums
    model.grads_and_flags and the scaler has no agreement of its own (what hpcdl.train builds).
    on_device: fp16 decides on the device (NOTE [device loss scale]).
    Returns (params before, params after, results, scale) on this rank."""
    from hpcdl.comm.collectives import AnyRank
    from hpcdl.comm.reducer import GradientReducer

    comm = comm_world()
    model = nn.build_model("cnn", (1, 8, 8), 10, seed=5)
    model.set_precision(precision)
    model.set_rng_state(nn.rank_rng_state(5, comm.rank))
    opt = nn.make_optimizer("sgd", model.params, model.grads, momentum=0.9)
    grads = model.grads_and_flags if carry else model.grads
    reducer = GradientReducer(comm, grads, bucket_mb=0.05, prescaled=True) if reduce else None
    any_rank = AnyRank(comm)
    scaler = LossScaler(None if carry else any_rank, on_device=on_device) if scaler_on else None
    rng = np.random.default_rng(100 + comm.rank)
    before = model.params.copy()
    results = []
    try:
        for step in range(steps):
            x = rng.standard_normal((8, 1, 8, 8)).astype(np.float32)
            if step == 0 and comm.rank == poison_rank:
                x[0, 0, 0, 0] = np.inf
            y = rng.integers(0, 10, 8)
            results.append(
                train_step(StepParts(model, opt, reducer=reducer, scaler=scaler), x, y, 0.05)
            )
    finally:
        if reducer:
            reducer.close()
        any_rank.close()
    return before, model.params.copy(), results, scaler.scale if scaler else None


@pytest.mark.parametrize(
    ("reduce", "carry"),
    [(True, False), (False, False), (True, True)],
    ids=["sync-grad", "no-gradient-reducer", "flag-carried-by-the-gradient-allreduce"],
)
def test_an_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(reduce, carry):
    """Without a gradient reducer (--sync params:K) rank 0's own gradients stay finite: only
    the scaler's explicit agreement makes it skip too. Carried: no agreement of its own, the
    overflow count rides after the gradients in the allreduce."""
    comm = comm_world()
    with np.errstate(over="ignore", invalid="ignore"):
        before, after, results, scale = ranks_step("fp16", True, 1, 1, reduce, carry)
    # one skipped step everywhere, the scale halved everywhere, the parameters untouched
    assert comm.allgather([r.applied for r in results]) == [[False]] * comm.size
    assert comm.allgather(scale) == [2.0**15] * comm.size
    np.testing.assert_array_equal(after, before)


def test_decided_on_the_device_one_ranks_overflow_skips_every_rank_and_matches_the_host():
    """The overflow count the gradient allreduce carried decides on every rank's device."""
    comm = comm_world()
    with np.errstate(over="ignore", invalid="ignore"):
        host = ranks_step("fp16", True, 1, 3, carry=True)
        device = ranks_step("fp16", True, 1, 3, carry=True, on_device=True)
    applied = [bool(r.applied) for r in device[2]]
    assert comm.allgather(applied) == [[False, True, True]] * comm.size
    assert applied == [r.applied for r in host[2]] and device[3] == host[3] == 2.0**15
    np.testing.assert_array_equal(device[1], host[1])  # the host rule's bits


@pytest.mark.parametrize("carry", [False, True], ids=["own-agreement", "carried"])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_reduced_precision_ranks_keep_bitwise_identical_parameters(precision, carry):
    comm = comm_world()
    before, after, results, _ = ranks_step(precision, precision == "fp16", None, 3, carry=carry)
    assert all(r.applied for r in results)
    assert not np.array_equal(after, before)
    digests = comm.allgather(after.tobytes())
    assert all(d == digests[0] for d in digests)


def test_one_ranks_non_finite_loss_reaches_every_rank_in_the_gradient_allreduce():
    """The loss flag rides after the gradients: every rank counts rank 1's NaN loss, with no
    collective but the gradient allreduce (hpcdl.train reads the count every --metrics-every)."""
    comm = comm_world()
    with np.errstate(over="ignore", invalid="ignore"):
        _, _, results, _ = ranks_step("fp32", False, 1, steps=2, carry=True)
    # step 1: rank 1's loss; its NaN gradients, averaged, poison every rank's step 2
    seen = [float(r.nonfinite_ranks) for r in results]
    assert comm.allgather(seen) == [[1.0, float(comm.size)]] * comm.size
