"""hpcdl.train --sync-bn with a torch model (hpcdl.torch_engine.sync_batch_norm): the layer on
2 ranks against torch's BatchNorm over the joined batch, convert()'s swap, and the training
loop keeping every rank's BatchNorm statistics identical (pytest --with-mpi under mpirun)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import digest

torch = pytest.importorskip("torch")

from hpcdl import resume  # noqa: E402 (after the skip: these import torch's engine)
from hpcdl import train as trainer  # noqa: E402
from hpcdl.config import parse_args  # noqa: E402
from hpcdl.torch_engine.sync_batch_norm import SyncBatchNorm, convert  # noqa: E402

MODELS = Path(__file__).parent / "torch_models.py"
STEPS = 4


def test_convert_swaps_every_batch_norm_keeping_its_tensors_and_state_dict_keys():
    model = torch.nn.Sequential(
        torch.nn.BatchNorm1d(3),
        torch.nn.Sequential(torch.nn.Conv2d(1, 4, 1), torch.nn.BatchNorm2d(4, momentum=None)),
        torch.nn.BatchNorm3d(2, affine=False),
        torch.nn.SyncBatchNorm(5),
    )
    before = model.state_dict(keep_vars=True)
    reducer = object()
    converted = convert(model, reducer)
    norms = [m for m in converted.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    assert len(norms) == 4 and all(type(m) is SyncBatchNorm for m in norms)
    assert all(m.reducer is reducer for m in norms)
    after = converted.state_dict(keep_vars=True)
    assert list(after) == list(before)
    assert all(after[k] is before[k] for k in before)  # the same tensors: no copy to go stale
    assert norms[1].momentum is None and not norms[2].affine
    assert [type(m) for m in convert(torch.nn.BatchNorm2d(2), None).modules()] == [SyncBatchNorm]


@pytest.mark.mpi(min_size=2)
def test_two_ranks_with_half_a_batch_each_equal_batch_norm_over_the_whole_batch(world):
    """float64: outputs, input and affine gradients, running statistics (two steps) and the
    evaluation output of one torch.nn.BatchNorm2d over the joined batch, to rounding."""
    from hpcdl.comm.collectives import SumReducer  # noqa: PLC0415

    comm, rank, half = world.comm, world.rank, 3
    g = torch.Generator().manual_seed(11)
    plain = torch.nn.BatchNorm2d(4).double()
    with torch.no_grad():
        plain.weight.copy_(torch.rand(4, generator=g, dtype=torch.float64) + 0.5)
        plain.bias.copy_(torch.randn(4, generator=g, dtype=torch.float64))
    sums = SumReducer(comm)
    try:
        sync = SyncBatchNorm(4, reducer=sums).double()
        sync.load_state_dict(plain.state_dict())
        mine = slice(half * rank, half * (rank + 1))
        for _ in range(2):
            everyone = torch.randn(comm.size * half, 4, 5, 3, generator=g, dtype=torch.float64)
            everyone = everyone * 3 + 1
            x, full = everyone[mine].clone().requires_grad_(), everyone.clone().requires_grad_()
            out, expected = sync(x), plain(full)
            weights = torch.randn(expected.shape, generator=g, dtype=torch.float64)
            (out * weights[mine]).sum().backward()
            (expected * weights).sum().backward()
            close(out, expected[mine])
            close(x.grad, full.grad[mine])
            for mine_grad, whole in ((sync.weight.grad, plain.weight.grad),
                                     (sync.bias.grad, plain.bias.grad)):  # fmt: skip
                summed = mine_grad.detach().clone()
                sums(summed.numpy())  # each rank holds its samples' share
                close(summed, whole)
            close(sync.running_mean, plain.running_mean)
            close(sync.running_var, plain.running_var)
            sync.zero_grad()
            plain.zero_grad()
        assert int(sync.num_batches_tracked) == int(plain.num_batches_tracked) == 2
        sync.eval()
        plain.eval()
        close(sync(x.detach()), plain(x.detach()))
    finally:
        sums.close()


def close(got, expected) -> None:
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("sync_bn", [False, True], ids=["own-batch", "sync-bn"])
def test_sync_bn_keeps_batch_norm_statistics_identical_on_every_rank_after_every_step(
    world,  # noqa: F811
    shared_digits,  # noqa: F811
    mpi_tmp_path,
    monkeypatch,
    sync_bn,
):
    """tests/torch_models.py's small_cnn through hpcdl.train's loop, a checkpoint after every
    step: the parameters agree at every step either way; the BatchNorm running statistics
    differ between the ranks within the epoch (each rank normalised its own batch) unless
    --sync-bn, where every rank's are the same, bit for bit, after every step."""
    cfg = parse_args(
        [
            *("--data", str(shared_digits / "train"), "--model", f"{MODELS}:small_cnn"),
            *("--epochs", "1", "--batch-size", "16", "--workers", "0", "--seed", "5"),
            *("--lr", "0.05", "--max-steps", str(STEPS), "--quiet"),
            *("--checkpoint-dir", str(mpi_tmp_path / f"ckpt-{sync_bn}"), "--checkpoint-every", "1"),
            *(["--sync-bn"] if sync_bn else []),
        ]
    )
    after_step: dict[int, tuple[str, str]] = {}  # step -> digests of (params, buffers)
    real_save = resume.save

    def save(run, at, epoch_stats=None):  # --checkpoint-every 1: every rank after every step
        model = run.engine.model
        after_step[at.global_step] = (digest(model.params), digest(model.buffers))
        return real_save(run, at, epoch_stats)

    monkeypatch.setattr(resume, "save", save)
    assert trainer.train(cfg, world) == 0
    everyone = world.comm.allgather(after_step)
    assert sorted(after_step) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert len({ranks[step][0] for ranks in everyone}) == 1, f"parameters differ at {step}"
    buffers = [len({ranks[step][1] for ranks in everyone}) for step in range(1, STEPS)]
    assert buffers == ([1] * (STEPS - 1) if sync_bn else [world.size] * (STEPS - 1))
    assert after_step[1][0] != after_step[STEPS][0]  # it trained
