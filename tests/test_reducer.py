"""GradientReducer equals one flat Allreduce, for any bucket size, on both code paths (MPI)."""

import numpy as np
import pytest
from helpers import wait_until

from hpcdl.comm.reducer import GradientReducer, plan_buckets


def test_plan_buckets_covers_buffer_in_order():
    buckets = plan_buckets(1_000_000, 4, bucket_mb=1.5)
    assert buckets[0].lo == 0 and buckets[-1].hi == 1_000_000
    assert all(a.hi == b.lo for a, b in zip(buckets, buckets[1:]))
    assert buckets[0].hi - buckets[0].lo == (1 << 20) // 4  # small first bucket
    assert buckets[1].hi - buckets[1].lo == int(1.5 * (1 << 20)) // 4
    assert len(plan_buckets(10, 4, bucket_mb=100)) == 1


def test_plan_buckets_merges_a_sliver_at_the_end():
    first = (1 << 20) // 4
    merged = plan_buckets(first + first // 8, 4, bucket_mb=25)  # resnet20-like: 1 MiB + 30 KB
    assert [(b.lo, b.hi) for b in merged] == [(0, first + first // 8)]
    kept = plan_buckets(first + first // 2, 4, bucket_mb=25)
    assert [(b.lo, b.hi) for b in kept] == [(0, first), (first, first + first // 2)]


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
    """Buckets marked early are reduced by the helper thread before wait() is called (while
    "backward" goes on); the rest by wait()."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    grads = _local_grads(comm.rank, 4 << 20)
    local = grads.copy()
    expected = np.empty_like(grads)
    comm.Allreduce(grads, expected, op=MPI.SUM)
    expected /= comm.size
    reducer = GradientReducer(comm, grads, bucket_mb=1.0)
    try:
        reducer.begin_step()
        reducer.mark_ready(grads.size // 2)
        reducer.mark_ready(grads.size // 2)  # the next layer's backward ends: nothing new
        early = max(b.hi for b in reducer.buckets if b.hi <= grads.size // 2)
        # the rest of backward: the helper thread reduces every early bucket meanwhile
        wait_until(
            lambda: np.allclose(grads[:early], expected[:early], rtol=1e-6, atol=1e-7),
            30,
            "the early buckets reduced before wait()",
        )
        np.testing.assert_array_equal(grads[early:], local[early:])  # and nothing else
        reducer.wait()
        np.testing.assert_allclose(grads, expected, rtol=1e-6, atol=1e-7)
    finally:
        reducer.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("host_staged", [False, True])
def test_prescaled_reducer_sums_gradients_of_the_scaled_loss_to_the_average(host_staged):
    """hpcdl.train scales the loss gradient by 1/N and lets the reducer only sum."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    n = 100_003
    grads = _local_grads(comm.rank, n)
    expected = np.empty_like(grads)
    comm.Allreduce(grads, expected, op=MPI.SUM)
    expected /= comm.size
    grads *= np.float32(1.0 / comm.size)
    reducer = GradientReducer(comm, grads, 0.1, host_staged=host_staged, prescaled=True)
    try:
        reducer.begin_step()
        reducer.mark_ready(n // 2)
        reducer.wait()
    finally:
        reducer.close()
    np.testing.assert_allclose(grads, expected, rtol=1e-6, atol=1e-7)
    if comm.size in (2, 4):  # scaling by a power of two is exact: bitwise the same average
        np.testing.assert_array_equal(grads, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("host_staged", [True, False])
def test_gpu_reducer_waits_for_the_kernels_that_wrote_each_bucket(host_staged):
    """Each bucket is marked ready right after slow kernels that write it were enqueued on a
    non-default stream. A reducer that read a bucket before its event would copy stale zeros
    back over it (host-staged path); one rank's average is the values themselves."""
    pytest.importorskip("cupy")
    from hpcdl.backend import gpu_available

    if not gpu_available():
        pytest.skip("needs CuPy and a GPU")
    import cupy as cp
    from mpi4py import MPI

    from hpcdl.comm import cuda_aware

    if not host_staged and not cuda_aware.detect(MPI.COMM_SELF, "gpu").aware:
        pytest.skip("device buffers need a CUDA-aware MPI")
    n = 3 * (1 << 18)
    grads = cp.zeros(n, dtype=cp.float32)
    reducer = GradientReducer(MPI.COMM_SELF, grads, 1.0, host_staged=host_staged)
    a = cp.random.default_rng(0).standard_normal((2048, 2048), dtype=cp.float32)
    compute = cp.cuda.Stream(non_blocking=True)
    snapshots = []
    try:
        reducer.begin_step()
        with compute:
            for bucket in reducer.buckets:
                for _ in range(20):  # slow work that the bucket's values depend on
                    a = cp.tanh(a @ a)
                grads[bucket.lo : bucket.hi] = a.ravel()[: bucket.hi - bucket.lo] + 1
                snapshots.append(grads[bucket.lo : bucket.hi].copy())
                reducer.mark_ready(bucket.hi)
        reducer.wait()
        compute.synchronize()
        for bucket, snap in zip(reducer.buckets, snapshots):
            np.testing.assert_array_equal(grads[bucket.lo : bucket.hi].get(), snap.get())
    finally:
        reducer.close()
