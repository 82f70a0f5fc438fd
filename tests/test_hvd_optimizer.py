"""hvd.DistributedOptimizer, the broadcast helpers and SyncBatchNorm under mpirun (2 ranks; any
size >= 2 works), against plain mpi4py averages and against torch's DDP (gloo) on the same model,
data order and seed.

    mpirun -np 2 python -m pytest --with-mpi -m mpi -q -p no:cacheprovider \\
        tests/test_hvd_optimizer.py
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
hvd = pytest.importorskip("hpcdl.torch")

pytestmark = pytest.mark.mpi(min_size=2)
STEPS = 50


def world():
    from mpi4py import MPI

    hvd.init()
    return MPI.COMM_WORLD


def net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 3)
    )


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s batch of step `step`: the same on every run (the data order)."""
    g = torch.Generator().manual_seed(10_000 * step + rank)
    return torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)


def mpi_average_grads(comm, model) -> list[np.ndarray]:
    from mpi4py import MPI

    out = []
    for p in model.parameters():
        g = p.grad.double().numpy().copy()
        comm.Allreduce(MPI.IN_PLACE, g, op=MPI.SUM)
        out.append(g / comm.size)
    return out


def local_grads(model, step: int, rank: int) -> None:
    x, y = batch(step, rank)
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()


def test_gradients_are_the_mpi_average_and_overlap_backward():
    comm = world()
    reference = net()
    local_grads(reference, 0, comm.rank)
    expected = mpi_average_grads(comm, reference)
    model = net()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    assert isinstance(opt, torch.optim.SGD)
    local_grads(model, 0, comm.rank)
    assert opt._open  # the hooks fired during backward: the buckets were handed over then
    opt.synchronize()
    for p, e in zip(model.parameters(), expected):
        assert np.allclose(p.grad.double().numpy(), e, rtol=1e-6, atol=1e-7)
    with opt.skip_synchronize():
        opt.step()


def test_matches_ddp_gloo_after_50_steps_of_sgd_with_momentum():
    import torch.distributed as dist

    comm = world()
    port = comm.bcast(_free_port() if comm.rank == 0 else None)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank, world_size=comm.size
    )
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(net())
        _train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9), comm.rank)
        ddp_params = [p.detach().clone() for p in ddp.module.parameters()]
    finally:
        dist.destroy_process_group()
    model = net()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        named_parameters=model.named_parameters(),
    )
    _train(model, opt, comm.rank)
    for a, b in zip(model.parameters(), ddp_params):
        assert torch.linalg.norm(a.detach() - b) <= 1e-5 * torch.linalg.norm(b)
    assert not torch.equal(ddp_params[0], net()[0].weight)  # it trained


def _train(model, opt, rank: int) -> None:
    for step in range(STEPS):
        x, y = batch(step, rank)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("op", ["Sum", "Min", "predivide", "fp16"])
def test_ops_compression_and_predivide(op):
    from mpi4py import MPI

    comm = world()
    reference = net()
    local_grads(reference, 1, comm.rank)
    kwargs = {
        "Sum": {"op": hvd.Sum},
        "Min": {"op": hvd.Min},
        "predivide": {"gradient_predivide_factor": 4.0},
        "fp16": {"compression": hvd.Compression.fp16},
    }[op]
    mpi_op = {"Sum": MPI.SUM, "Min": MPI.MIN}.get(op, MPI.SUM)
    expected = []
    for p in reference.parameters():
        g = p.grad.double().numpy().copy()
        comm.Allreduce(MPI.IN_PLACE, g, op=mpi_op)
        expected.append(g if op in ("Sum", "Min") else g / comm.size)
    model = net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)
    local_grads(model, 1, comm.rank)
    opt.synchronize()
    tolerance = 2e-3 if op == "fp16" else 1e-6
    for p, e in zip(model.parameters(), expected):
        assert p.grad.dtype == torch.float32
        assert np.allclose(
            p.grad.double().numpy(), e, rtol=tolerance, atol=tolerance * np.abs(e).max()
        )


def test_backward_passes_per_step_accumulate_locally():
    comm = world()
    reference = net()
    reference.zero_grad()
    for step in (2, 3):
        x, y = batch(step, comm.rank)
        torch.nn.functional.cross_entropy(reference(x), y).backward()
    expected = mpi_average_grads(comm, reference)
    model = net()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), backward_passes_per_step=2
    )
    opt.zero_grad()
    for step in (2, 3):
        x, y = batch(step, comm.rank)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        assert opt._open == (step == 3)  # reduced only after the second pass
    with pytest.raises(AssertionError, match="backward_passes_per_step"):
        torch.nn.functional.cross_entropy(model(batch(4, comm.rank)[0]), batch(4, 0)[1]).backward()
    opt.synchronize()
    for p, e in zip(model.parameters(), expected):
        assert np.allclose(p.grad.double().numpy(), e, rtol=1e-6, atol=1e-7)


def test_a_parameter_without_gradient_on_one_rank_is_reduced_with_zeros():
    from mpi4py import MPI

    comm = world()

    def loss_of(model):  # the Linear layer gets no gradient on rank 0
        x, y = batch(5, comm.rank)
        features = model[2](model[1](model[0](x)))
        if comm.rank == 0:
            return features.square().mean()
        return torch.nn.functional.cross_entropy(model[3](features), y)

    reference = net()
    loss_of(reference).backward()
    local = reference[3].weight.grad
    expected = (torch.zeros_like(reference[3].weight) if local is None else local).double().numpy()
    comm.Allreduce(MPI.IN_PLACE, expected, op=MPI.SUM)
    model = net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    opt.zero_grad()
    loss_of(model).backward()
    opt.synchronize()  # no hang: rank 0 submits zeros for the Linear layer
    assert np.allclose(model[3].weight.grad.double().numpy(), expected / comm.size, atol=1e-7)


def test_clipping_between_synchronize_and_step_and_the_warning_without_skip():
    comm = world()
    model = net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    local_grads(model, 6, comm.rank)
    opt.synchronize()
    before = model[3].weight.grad.norm().item()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    clipped = model[3].weight.grad.clone()
    assert clipped.norm().item() < before
    with opt.skip_synchronize():
        opt.step()
    weight = model[3].weight.detach().clone()
    assert torch.allclose(weight, net()[3].weight - 0.1 * clipped)
    local_grads(model, 7, comm.rank)
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    assert any("skip_synchronize" in str(w.message) for w in caught)
    with pytest.raises(AssertionError, match="zero_grad"):
        local_grads(model, 8, comm.rank)  # zero_grad inside, then backward opens a step
        opt.zero_grad()
    opt.synchronize()


def test_broadcast_parameters_optimizer_state_and_objects():
    comm = world()
    model = net(seed=comm.rank)  # different weights on every rank
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (comm.rank + 1), betas=(0.8, 0.9))
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01)
    assert isinstance(opt.param_groups[0]["betas"], tuple)
    weights = comm.allgather(model[0].weight.detach().numpy())
    assert all(np.array_equal(w, weights[0]) for w in weights)
    local_grads(model, 9, comm.rank)
    opt.step()
    states = comm.allgather([v.numpy() for v in opt.state[model[0].weight].values()])
    assert all(np.array_equal(a, b) for a, b in zip(states[0], states[-1]))
    assert hvd.broadcast_object({"epoch": 3} if comm.rank == 0 else None) == {"epoch": 3}
    assert hvd.allgather_object(("rank", comm.rank)) == [("rank", r) for r in range(comm.size)]


def test_sync_batch_norm_equals_batch_norm_on_the_global_batch():
    comm = world()
    g = torch.Generator().manual_seed(7)
    everyone = torch.randn(comm.size * 3, 4, 5, 5, generator=g) * 3 + 1
    mine = everyone[3 * comm.rank : 3 * comm.rank + 3].clone().requires_grad_()
    full = everyone.clone().requires_grad_()
    sync, plain = hvd.SyncBatchNorm(4), torch.nn.BatchNorm2d(4)
    out_sync, out_plain = sync(mine), plain(full)
    assert torch.allclose(out_sync, out_plain[3 * comm.rank : 3 * comm.rank + 3], atol=1e-5)
    assert torch.allclose(sync.running_mean, plain.running_mean, atol=1e-6)
    assert torch.allclose(sync.running_var, plain.running_var, atol=1e-5)
    weights = torch.arange(float(out_plain.numel())).view(out_plain.shape)
    (out_sync * weights[3 * comm.rank : 3 * comm.rank + 3]).sum().backward()
    (out_plain * weights).sum().backward()
    assert torch.allclose(mine.grad, full.grad[3 * comm.rank : 3 * comm.rank + 3], atol=1e-3)
    assert torch.allclose(hvd.allreduce(sync.weight.grad, op=hvd.Sum), plain.weight.grad, atol=1e-2)
    sync.eval()
    assert torch.allclose(sync(mine.detach()), plain.eval()(mine.detach()), atol=1e-5)


def test_wrong_arguments_and_layouts_fail_on_every_rank():
    comm = world()
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    both = list(a.parameters()) + list(b.parameters())
    with pytest.raises(ValueError, match="unique"):
        hvd.DistributedOptimizer(
            torch.optim.SGD(both, lr=0.1),
            named_parameters=[*a.named_parameters(), *b.named_parameters()],
        )
    with pytest.raises(ValueError, match="not named"):
        hvd.DistributedOptimizer(
            torch.optim.SGD(both, lr=0.1), named_parameters=list(a.named_parameters())
        )
    with pytest.raises(hvd.NotBuilt, match="Adasum"):
        hvd.DistributedOptimizer(torch.optim.SGD(a.parameters(), lr=0.1), op=hvd.Adasum)
    uneven = torch.nn.Linear(2, 2 + comm.rank)
    with pytest.raises(ValueError, match="every rank must build the same model"):
        hvd.DistributedOptimizer(torch.optim.SGD(uneven.parameters(), lr=0.1))


def test_start_timeline_records_every_ranks_bucket_allreduces(tmp_path_factory):
    """hvd.start_timeline / stop_timeline (Horovod's names) write hpcdl's timeline: a Chrome trace
    with one track per rank and each DistributedOptimizer bucket's allreduce, merged by rank 0."""
    import json

    from mpi4py import MPI

    comm = world()
    folder = comm.bcast(str(tmp_path_factory.mktemp("timeline")) if comm.rank == 0 else None)
    trace = f"{folder}/hvd.json"
    model = net()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    hvd.start_timeline(trace)
    with pytest.raises(ValueError, match="already"):
        hvd.start_timeline(trace)
    for step in range(3):
        x, y = batch(step, comm.rank)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    hvd.stop_timeline()
    hvd.stop_timeline()  # a second stop does nothing, as in Horovod
    comm.Barrier()
    events = json.loads(open(trace).read())["traceEvents"]
    for rank in range(comm.size):
        reduced = [e for e in events if e.get("pid") == rank and e["name"] == "allreduce"]
        assert len(reduced) >= 3 and all(e["args"]["bytes"] > 0 for e in reduced), (rank, events)
    assert MPI.COMM_WORLD.allreduce(1) == comm.size  # the ranks still agree afterwards
