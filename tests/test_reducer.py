"""GradientReducer equals one flat Allreduce, for any bucket size, on both code paths (MPI)."""

import numpy as np
import pytest

from hpcdl.comm.reducer import GradientReducer, plan_buckets


def test_plan_buckets_covers_buffer_in_order():
    buckets = plan_buckets(1_000_000, 4, bucket_mb=1.5)
    assert buckets[0].lo == 0 and buckets[-1].hi == 1_000_000
    assert all(a.hi == b.lo for a, b in zip(buckets, buckets[1:]))
    assert buckets[0].hi - buckets[0].lo == (1 << 20) // 4  # small first bucket
    assert buckets[1].hi - buckets[1].lo == int(1.5 * (1 << 20)) // 4
    assert len(plan_buckets(10, 4, bucket_mb=100)) == 1


def test_plan_buckets_rejects_non_positive_size():
    with pytest.raises(ValueError, match="bucket size"):
        plan_buckets(10, 4, 0)


def _local_grads(rank, n, dtype=np.float32):
    return np.random.default_rng(100 + rank).standard_normal(n).astype(dtype)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("host_staged", [False, True])
@pytest.mark.parametrize("bucket_mb", [1 / 1024, 0.01, 1.0, 25.0, 1000.0])
def test_reducer_equals_flat_allreduce(bucket_mb, host_staged):
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    n = 300_001
    grads = _local_grads(comm.rank, n)
    expected = np.empty_like(grads)
    comm.Allreduce(grads, expected, op=MPI.SUM)
    expected /= comm.size
    reducer = GradientReducer(comm, grads, bucket_mb=bucket_mb, host_staged=host_staged)
    try:
        for _ in range(2):  # the reducer is reusable step after step
            grads[:] = _local_grads(comm.rank, n)
            reducer.begin_step()
            for ready in (1000, 50_000, 200_000, n):  # backward marks readiness in pieces
                reducer.mark_ready(ready)
            reducer.wait()
            np.testing.assert_allclose(grads, expected, rtol=1e-6, atol=1e-7)
            if comm.size == 2:  # a + b is exact and symmetric: identical on both ranks
                np.testing.assert_array_equal(grads, expected)
            everyone = comm.allgather(grads.tobytes())
            assert all(b == everyone[0] for b in everyone)
    finally:
        reducer.close()


@pytest.mark.mpi(min_size=2)
def test_reducer_overlaps_with_work_between_marks():
    """Buckets marked early are already reduced before wait() is called."""
    import time

    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    grads = _local_grads(comm.rank, 4 << 20)
    reducer = GradientReducer(comm, grads, bucket_mb=1.0)
    try:
        reducer.begin_step()
        reducer.mark_ready(grads.size // 2)
        time.sleep(0.5)  # stands in for the rest of backward
        reducer.wait()
        assert reducer.last_exposed_s < reducer.last_comm_s + 0.5
        assert reducer.last_unmarked == len(reducer.buckets) - len(
            [b for b in reducer.buckets if b.hi <= grads.size // 2]
        )
    finally:
        reducer.close()
