"""hpcdl.torch's Horovod collectives under mpirun (2 ranks; any size >= 2 works), checked
against plain mpi4py on the same data: every op and dtype, pre/postscale, in-place, async and
grouped forms, autograd, name matching out of order, join, and the errors that must reach
every rank without a hang.

    mpirun -np 2 python -m pytest --with-mpi -m mpi -q -p no:cacheprovider \
        tests/test_hvd_collectives.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
hvd = pytest.importorskip("hpcdl.torch")

pytestmark = pytest.mark.mpi(min_size=2)

DTYPES = [torch.uint8, torch.int32, torch.int64, torch.float16, torch.float32, torch.float64]


def world():
    from mpi4py import MPI

    hvd.init()
    return MPI.COMM_WORLD


def data(rank: int, shape, dtype) -> torch.Tensor:
    """A rank's own values: small, so that sums and products stay exact in every dtype."""
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randint(1, 4, shape, generator=g).to(dtype)


def mpi_reduce(comm, t: torch.Tensor, op) -> np.ndarray:
    """The reference: mpi4py's Allreduce of the values in float64 (exact for these data)."""
    from mpi4py import MPI

    out = t.double().numpy().copy()
    comm.Allreduce(MPI.IN_PLACE, out, op=op)
    return out


def test_process_functions_match_mpi():
    comm = world()
    node = comm.Split_type(0)  # MPI_COMM_TYPE_SHARED
    assert (hvd.rank(), hvd.size()) == (comm.rank, comm.size)
    assert (hvd.local_rank(), hvd.local_size()) == (node.rank, node.size)
    assert hvd.cross_size() == 1 and hvd.cross_rank() == 0  # one node in this test
    assert hvd.is_initialized() and hvd.mpi_built() and hvd.mpi_enabled()
    assert not hvd.gloo_built() and hvd.nccl_built() == 0 and not hvd.rocm_built()
    assert hvd.cuda_built() == torch.cuda.is_available()
    hvd.init()  # a second init is a no-op
    assert hvd.size() == comm.size


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_allreduce_every_op_matches_mpi(dtype):
    from mpi4py import MPI

    comm = world()
    t = data(comm.rank, (5, 3), dtype)
    for op, ref in (
        (hvd.Sum, MPI.SUM),
        (hvd.Min, MPI.MIN),
        (hvd.Max, MPI.MAX),
        (hvd.Product, MPI.PROD),
    ):
        out = hvd.allreduce(t, op=op)
        assert out.dtype == dtype and out.shape == t.shape
        assert np.array_equal(out.double().numpy(), mpi_reduce(comm, t, ref)), op
    average = hvd.allreduce(t)
    expected = mpi_reduce(comm, t, MPI.SUM) / comm.size
    if not dtype.is_floating_point:
        expected = np.trunc(expected)  # Horovod: scaled in float64, truncated
    assert np.allclose(average.double().numpy(), expected, rtol=1e-3)
    assert torch.equal(t, data(comm.rank, (5, 3), dtype))  # the input is not modified


def test_pre_and_postscale_and_bfloat16():
    from mpi4py import MPI

    comm = world()
    t = data(comm.rank, (7,), torch.float64)
    out = hvd.allreduce(t, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0)
    assert np.allclose(out.numpy(), 1.5 * mpi_reduce(comm, t, MPI.SUM))
    ints = hvd.allreduce(data(comm.rank, (7,), torch.int32), op=hvd.Sum, prescale_factor=0.5)
    halves = [np.trunc(data(r, (7,), torch.int32).double().numpy() * 0.5) for r in range(comm.size)]
    assert np.array_equal(ints.numpy(), np.sum(halves, axis=0))
    bf = hvd.allreduce(t.to(torch.bfloat16), op=hvd.Max)
    assert bf.dtype == torch.bfloat16
    assert np.array_equal(bf.double().numpy(), mpi_reduce(comm, t, MPI.MAX))


def test_inplace_async_and_grouped_forms():
    from mpi4py import MPI

    comm = world()
    tensors = [data(comm.rank, (n, 2), torch.float32) for n in (1, 4, 9)]
    expected = [mpi_reduce(comm, t, MPI.SUM) for t in tensors]
    handles = [hvd.allreduce_async(t, op=hvd.Sum) for t in tensors]
    assert not all(hvd.poll(h) for h in handles)  # nothing ran yet: it is asynchronous
    for h, e in zip(reversed(handles), reversed(expected)):
        assert np.array_equal(hvd.synchronize(h).double().numpy(), e)
    grouped = hvd.grouped_allreduce(tensors, op=hvd.Sum)
    assert all(np.array_equal(g.double().numpy(), e) for g, e in zip(grouped, expected))
    copies = [t.clone() for t in tensors]
    hvd.grouped_allreduce_(copies, op=hvd.Sum)
    assert all(np.array_equal(g.double().numpy(), e) for g, e in zip(copies, expected))
    single = tensors[1].clone()
    assert hvd.allreduce_(single, op=hvd.Sum) is single
    assert np.array_equal(single.double().numpy(), expected[1])
    handle = hvd.grouped_allreduce_async_(copies, op=hvd.Min)
    assert len(hvd.synchronize(handle)) == 3


def test_names_match_across_ranks_in_any_order():
    comm = world()
    a, b = torch.full((3,), 1.0 + comm.rank), torch.full((5,), 10.0 * (comm.rank + 1))
    names = ["a", "b"] if comm.rank % 2 == 0 else ["b", "a"]
    handles = {n: hvd.allreduce_async({"a": a, "b": b}[n], name=n, op=hvd.Sum) for n in names}
    sums = {n: hvd.synchronize(handles[n]) for n in reversed(names)}  # not submission order
    size = comm.size
    ranks_sum = size * (size + 1) / 2  # of rank + 1 over the ranks
    assert torch.equal(sums["a"], torch.full((3,), ranks_sum))
    assert torch.equal(sums["b"], torch.full((5,), 10.0 * ranks_sum))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int64, torch.float16, torch.float32], ids=str)
def test_allgather_rows_differ_by_rank(dtype):
    comm = world()
    t = data(comm.rank, (comm.rank + 1, 2, 3), dtype)
    out = hvd.allgather(t)
    expected = np.concatenate(comm.allgather(t.numpy()))
    assert out.dtype == dtype and np.array_equal(out.numpy(), expected)
    grouped = hvd.grouped_allgather([t, t[:1]])
    assert np.array_equal(grouped[0].numpy(), expected)
    assert grouped[1].shape[0] == comm.size
    assert np.array_equal(hvd.synchronize(hvd.allgather_async(t)).numpy(), expected)


def test_broadcast_from_every_root_in_and_out_of_place():
    comm = world()
    for root in range(comm.size):
        t = data(comm.rank, (4, 4), torch.float32)
        out = hvd.broadcast(t, root)
        assert np.array_equal(out.numpy(), comm.bcast(t.numpy(), root=root))
        assert torch.equal(t, data(comm.rank, (4, 4), torch.float32))  # not modified
        hvd.broadcast_(t, root_rank=root)
        assert torch.equal(t, out)


def test_alltoall_with_and_without_splits():
    comm = world()
    size, rank = comm.size, comm.rank
    splits = [(rank + dest) % 3 for dest in range(size)]
    rows = [torch.full((n, 2), float(100 * rank + dest)) for dest, n in enumerate(splits)]
    out, received = hvd.alltoall(torch.cat(rows), torch.tensor(splits, dtype=torch.int32))
    expected = comm.alltoall([r.numpy() for r in rows])
    assert np.array_equal(out.numpy(), np.concatenate(expected))
    assert received.dtype == torch.int32
    assert received.tolist() == [len(e) for e in expected]
    equal = hvd.alltoall(torch.arange(2.0 * size) + 100 * rank)
    assert equal.tolist() == [100.0 * src + 2 * rank + k for src in range(size) for k in (0, 1)]


def test_reducescatter_splits_dim0_like_horovod():
    from mpi4py import MPI

    comm = world()
    size, rank = comm.size, comm.rank
    rows = 2 * size + 1  # uneven: the first rank gets one row more
    t = data(rank, (rows, 3), torch.float64)
    total = mpi_reduce(comm, t, MPI.SUM)
    counts = [rows // size + (1 if r < rows % size else 0) for r in range(size)]
    start = sum(counts[:rank])
    summed = hvd.reducescatter(t, op=hvd.Sum)
    assert np.array_equal(summed.numpy(), total[start : start + counts[rank]])
    averaged = hvd.reducescatter(t)
    assert np.allclose(averaged.numpy(), total[start : start + counts[rank]] / size)
    grouped = hvd.grouped_reducescatter([t, t * 2], op=hvd.Sum)
    assert np.array_equal(grouped[1].numpy(), 2 * summed.numpy())


def test_gradients_through_the_collectives():
    comm = world()
    size, rank = comm.size, comm.rank
    x = torch.ones(3, 2, requires_grad=True)
    hvd.allreduce(x, op=hvd.Sum).backward(torch.ones(3, 2))
    assert torch.equal(x.grad, torch.full((3, 2), float(size)))
    y = torch.ones(rank + 1, 2, requires_grad=True)
    hvd.allgather(y).backward(torch.arange(float(sum(range(1, size + 1)))).repeat(2, 1).T)
    first = sum(range(1, rank + 1))
    assert torch.equal(y.grad[:, 0], torch.arange(float(first), first + rank + 1))
    z = torch.ones(4, requires_grad=True)
    hvd.broadcast(z, 0).backward(torch.ones(4))
    assert torch.equal(z.grad, torch.full((4,), 1.0 if rank == 0 else 0.0))
    w = torch.ones(2 * size, requires_grad=True)
    hvd.alltoall(w).backward(torch.ones(2 * size))
    assert torch.equal(w.grad, torch.ones(2 * size))
    v = torch.ones(2 * size, 2, requires_grad=True)
    hvd.reducescatter(v, op=hvd.Sum).sum().backward()
    assert torch.equal(v.grad, torch.full((2 * size, 2), float(size)))


def test_disagreements_fail_on_every_rank_and_the_next_collective_works():
    comm = world()
    rank = comm.rank
    cases = [
        (lambda: hvd.allreduce(torch.ones(3 + rank)), RuntimeError, "shape"),
        (
            lambda: hvd.allreduce(torch.ones(3, dtype=torch.float32 if rank else torch.int32)),
            RuntimeError,
            "dtype",
        ),
        (lambda: hvd.allreduce(torch.ones(3), op=hvd.Sum if rank else hvd.Max), RuntimeError, "op"),
        (lambda: hvd.broadcast(torch.ones(3), rank), RuntimeError, "root rank"),
        (lambda: hvd.broadcast(torch.ones(3), comm.size), RuntimeError, "out of range"),
        (lambda: hvd.allgather(torch.ones(2, 2 + rank)), RuntimeError, "shape"),
        (lambda: hvd.alltoall(torch.ones(comm.size + 1)), ValueError, "not a multiple"),
        (lambda: hvd.reducescatter(torch.tensor(1.0)), ValueError, "scalar"),
        (
            lambda: (
                hvd.allreduce(torch.ones(2), name="x")
                if rank
                else hvd.allgather(torch.ones(2), name="x")
            ),
            RuntimeError,
            "collective",
        ),
    ]
    for call, error, words in cases:
        with pytest.raises(error, match=words):
            call()
        assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [comm.size] * 2


def test_duplicate_name_in_flight_is_refused_on_that_rank_only():
    comm = world()
    t = torch.ones(4)
    if comm.rank == 0:
        first = hvd.allreduce_async(t, name="dup", op=hvd.Sum)
        with pytest.raises(ValueError, match="already in flight"):
            hvd.allreduce_async(t, name="dup")
    hvd.barrier()
    if comm.rank != 0:
        first = hvd.allreduce_async(t, name="dup", op=hvd.Sum)
        with pytest.raises(ValueError, match="already in flight"):
            hvd.allreduce_async(t, name="dup")
    assert hvd.synchronize(first).tolist() == [comm.size] * 4


def test_join_stands_in_with_zeros_and_returns_the_last_rank():
    comm = world()
    size, rank = comm.size, comm.rank
    if rank == 0:
        last = hvd.join()
    else:
        out = hvd.allreduce(torch.full((3,), 6.0))  # Average over the whole size
        assert out.tolist() == [6.0 * (size - 1) / size] * 3
        with pytest.raises(RuntimeError, match="join"):
            hvd.allgather(torch.ones(1))
        last = hvd.join()
    assert last != 0
    assert comm.allgather(last) == [last] * size


def test_barrier_waits_for_every_rank_and_runs_what_was_queued(tmp_path):
    """Rank 0 enters the barrier late and leaves a mark just before: every other rank must see
    the mark once its barrier returns."""
    import time

    comm = world()
    mark = Path(comm.bcast(str(tmp_path / "rank0-entered"), root=0))
    handle = hvd.allreduce_async(torch.ones(2), op=hvd.Sum)
    if comm.rank == 0:
        # Late on purpose: a barrier that did not wait would return on the other ranks in this
        # time, before the mark exists. What is checked is the mark, not the clock.
        time.sleep(0.5)
        mark.touch()
    hvd.barrier()
    assert mark.exists()
    assert hvd.poll(handle) and hvd.synchronize(handle).tolist() == [comm.size] * 2


def test_sparse_allreduce_equals_the_dense_one():
    comm = world()
    dense = torch.zeros(6, 2)
    dense[comm.rank % 6] = 1.0 + comm.rank
    wait = hvd.sparse_allreduce_async(dense.to_sparse(), name="sparse", op=hvd.Average)
    assert torch.allclose(hvd.synchronize(wait).to_dense(), hvd.allreduce(dense))


def test_what_is_not_built_says_so():
    world()
    for call in (
        lambda: hvd.add_process_set([0]),
        lambda: hvd.elastic.run,
        lambda: hvd.allreduce(torch.ones(1), process_set=hvd.ProcessSet([0])),
    ):
        with pytest.raises(hvd.NotBuilt, match="does not build"):
            call()
    with pytest.raises(hvd.NotBuilt, match="Adasum"):
        hvd.allreduce(torch.ones(2), op=hvd.Adasum)
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [hvd.size()] * 2
