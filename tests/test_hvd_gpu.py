"""hpcdl.torch on GPU tensors under mpirun (2 ranks, one GPU each or one shared): the
collectives and DistributedOptimizer give what the same calls give on CPU tensors, through
CUDA-aware MPI when hpcdl's decision says so, else through pinned host buffers (both are run:
HPCDL_CUDA_AWARE=0 forces the second). Skips without CUDA, and DistributedOptimizer without CuPy.

    mpirun -np 2 python -m pytest --with-mpi -m mpi -q -p no:cacheprovider tests/test_hvd_gpu.py
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
hvd = pytest.importorskip("hpcdl.torch")

pytestmark = [
    pytest.mark.mpi(min_size=2),
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def device():
    hvd.init()
    return torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())


@pytest.mark.parametrize("aware", [None, False], ids=["decided", "host-staged"])
def test_collectives_on_gpu_equal_the_cpu_ones(aware):
    dev = device()
    engine = hvd.process.state().engine
    saved = engine.aware
    engine.aware = saved if aware is None else aware
    try:
        g = torch.Generator().manual_seed(hvd.rank())
        t = torch.randint(0, 5, (33, 4), generator=g).float()
        for fn in (
            lambda x: hvd.allreduce(x, op=hvd.Sum),
            lambda x: hvd.allgather(x),
            lambda x: hvd.broadcast(x, 1),
            lambda x: hvd.alltoall(x[:32]),
            lambda x: hvd.reducescatter(x, op=hvd.Sum),
            lambda x: hvd.allreduce(x.bfloat16(), op=hvd.Max),
        ):
            on_gpu, on_cpu = fn(t.to(dev)), fn(t)
            assert on_gpu.device.type == "cuda"
            assert torch.equal(on_gpu.cpu(), on_cpu)
    finally:
        engine.aware = saved


def test_distributed_optimizer_on_gpu_equals_cpu():
    pytest.importorskip("cupy")
    dev = device()

    def grads(where):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)
        ).to(where)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        g = torch.Generator().manual_seed(hvd.rank())
        x = torch.randn(8, 16, generator=g).to(where)
        model(x).square().mean().backward()
        opt.synchronize()
        return [p.grad.cpu() for p in model.parameters()]

    for a, b in zip(grads(dev), grads("cpu")):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_backward_on_a_scripts_own_stream_marks_buckets_on_that_stream():
    """Under `with torch.cuda.stream(s)` the hooks copy gradients on s; the reducer's ready
    events must be recorded on s too (an event on CuPy's default stream need not wait for
    those copies). The backward is queued behind a long sleep on s, and the averages must equal
    the CPU ones. (On an H100 with a host-staged Open MPI 4.1 the averages came out right even
    with the events on the default stream; the stream check is what failed there.)"""
    cupy = pytest.importorskip("cupy")
    dev = device()

    def grads(where, stream=None):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)
        ).to(where)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        seen = []
        for slots in opt._slots:
            mark_ready = slots.reducer.mark_ready

            def spy(n, mark_ready=mark_ready):
                seen.append(cupy.cuda.get_current_stream().ptr)
                mark_ready(n)

            slots.reducer.mark_ready = spy
        g = torch.Generator().manual_seed(hvd.rank())
        x = torch.randn(8, 16, generator=g).to(where)
        with torch.cuda.stream(stream):  # None: no stream of its own (the CPU run)
            if stream is not None:
                torch.cuda._sleep(100_000_000)  # the gradient copies land well after this
            model(x).square().mean().backward()
            opt.synchronize()
        if stream is not None:
            stream.synchronize()
        return [p.grad.cpu() for p in model.parameters()], seen

    stream = torch.cuda.Stream(dev)
    on_gpu, seen = grads(dev, stream)
    on_cpu, _ = grads("cpu")
    assert seen and set(seen) == {stream.cuda_stream}
    for a, b in zip(on_gpu, on_cpu):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
