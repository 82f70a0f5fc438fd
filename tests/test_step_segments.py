"""A step cut at the reducer's bucket boundaries (hpcdl.nn.step_segments.BucketCuts, NOTE [step
graphs]): the segment plan's ends are the buckets' ends, and running backward in those segments,
the buckets handed to the reducer only between them, gives the plain step's gradients bitwise
(2 ranks: `mpirun -np 2 python -m pytest --with-mpi -m mpi tests/test_step_segments.py`)."""

import numpy as np
import pytest

from hpcdl import nn
from hpcdl.nn.precision import LossScaler
from hpcdl.nn.step import StepParts, forward_backward
from hpcdl.nn.step_segments import BucketCuts, segment_plan


class Buckets:
    """The reducer's face the plan reads (buckets, grads): the real plan_buckets, no MPI."""

    def __init__(self, grads, bucket_mb):
        from hpcdl.comm.reducer import plan_buckets

        self.grads, self.world_size = grads, 1
        self.buckets = plan_buckets(grads.size, grads.dtype.itemsize, bucket_mb)

    def begin_step(self):
        pass


def model_and_batch(seed=0):
    model = nn.build_model("resnet20", (3, 8, 8), 10, seed=4)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((4, 3, 8, 8)).astype(np.float32)
    return model, x, rng.integers(0, 10, 4)


def expected_ends(reports, bucket_ends):
    """Each bucket's end -> the first report of backward that reaches it."""
    return sorted({min(n for n in reports if n >= end) for end in bucket_ends})


@pytest.mark.parametrize("bucket_mb", [0.01, 0.05, 1.0])
def test_the_segments_end_where_backward_first_completes_a_bucket(bucket_mb):
    model, x, y = model_and_batch()
    reducer = Buckets(model.grads_and_flags, bucket_mb)
    opt = nn.make_optimizer("sgd", model.params, model.grads)
    parts = StepParts(model, opt, reducer=reducer)
    reports = []
    forward_backward(parts, x, y, mark_ready=reports.append)
    reports.append(reducer.grads.size)  # the reducer's wait() takes the rest
    buffers = model.buffers.copy()
    plan = segment_plan(parts, x, y)
    np.testing.assert_array_equal(model.buffers, buffers)  # the dry run moved no statistics
    ends = [bucket.hi for bucket in reducer.buckets]
    assert [s.ready_upto for s in plan] == expected_ends(reports, ends)
    handed = [b for s in plan for b in s.buckets]
    assert handed == list(range(len(reducer.buckets)))  # every bucket once, in order
    for segment in plan:  # a segment's buckets lie inside what it finished
        assert ends[segment.buckets[-1]] <= segment.ready_upto
    names = [name for s in plan for name in s.params]
    assert sorted(names) == sorted(name for name, _, _ in model.layout())
    if bucket_mb == 1.0:  # resnet20 fits one bucket: one segment, the whole backward
        assert len(plan) == 1


def test_fp16_checks_overflows_the_same_in_segments():
    counts = []
    for segmented in (False, True):
        model, x, y = model_and_batch()
        model.set_precision("fp16")
        opt = nn.make_optimizer("sgd", model.params, model.grads)
        reducer = Buckets(model.grads_and_flags, 0.01)
        parts = StepParts(model, opt, reducer=reducer, scaler=LossScaler(init_scale=2.0**40))
        if segmented:
            assert len(segment_plan(parts, x, y)) > 1
        else:
            forward_backward(parts, x, y, mark_ready=lambda n: None)
        counts.append(float(model.step_flags[1]))
    assert counts[1] == counts[0] > 0  # every range checked once, cut or not


def handing_off(reducer, handoffs):
    """The host between two segments: note the handoff, mark the buckets ready."""

    def cut(n):
        handoffs.append(n)
        reducer.mark_ready(n)

    return cut


def comm_world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("host_staged", [False, True])
def test_segments_with_handoffs_between_them_give_the_plain_gradients(host_staged):
    from hpcdl.comm.reducer import GradientReducer

    comm = comm_world()
    results = []
    for segmented in (False, True):
        model, x, y = model_and_batch(seed=comm.rank)
        opt = nn.make_optimizer("sgd", model.params, model.grads)
        reducer = GradientReducer(
            comm, model.grads_and_flags, 0.01, host_staged=host_staged, prescaled=True
        )
        try:
            parts = StepParts(model, opt, reducer=reducer)
            handoffs = []
            cuts = BucketCuts(model, reducer, cut=handing_off(reducer, handoffs))
            forward_backward(parts, x, y, mark_ready=cuts if segmented else None)
            reducer.wait()
        finally:
            reducer.close()
        if segmented:
            assert handoffs == [s.ready_upto for s in cuts.segments] and len(handoffs) > 1
        results.append(model.grads_and_flags.copy())
    np.testing.assert_array_equal(results[1], results[0])
    everyone = comm.allgather(results[1])
    np.testing.assert_array_equal(everyone[0], everyone[1])  # reduced: the same on each rank
