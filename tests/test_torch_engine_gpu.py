"""The torch engine's device path (hpcdl/torch_engine/device.py): on the CPU the feed is a
no-copy view, channels_last and autocast follow the device; on a GPU (marked, skips without
CUDA) the batches arrive pinned-then-copied on their own stream, equal to the host's."""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hpcdl.torch_engine import device  # noqa: E402

CPU = torch.device("cpu")


def host_batches(count: int = 3, batch: int = 4):
    """(images (B, 3, 8, 8) float32, labels (B,) int64) NumPy batches, distinct values."""
    rng = np.random.default_rng(0)
    for _ in range(count):
        yield rng.random((batch, 3, 8, 8), np.float32), rng.integers(0, 10, batch)


def conv_net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.LazyLinear(2))


def test_on_the_cpu_the_batches_are_views_of_the_loaders_memory():
    want = list(host_batches())
    got = list(device.BatchFeed(CPU)(iter(want)))
    assert len(got) == len(want)
    for (x, y), (wx, wy) in zip(got, want):
        assert x.data_ptr() == wx.ctypes.data and y.data_ptr() == wy.ctypes.data  # no copy
        assert x.device == CPU and x.dtype == torch.float32 and y.dtype == torch.int64


def test_channels_last_only_for_a_convolutional_model_on_a_gpu():
    dense = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 2))
    assert not device.use_channels_last(conv_net(), CPU)
    assert not device.use_channels_last(dense, torch.device("cuda", 0))
    assert device.use_channels_last(conv_net(), torch.device("cuda", 0))


def test_placing_on_the_cpu_keeps_the_modules_tensors_where_they_are():
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3))
    before = net[0].weight.data_ptr()
    assert device.place(net, CPU) is False
    assert net[0].weight.data_ptr() == before and net[0].weight.is_contiguous()


def test_precision_is_autocast_of_the_devices_kind_or_nothing():
    a = torch.ones(4, 4)
    with device.precision(CPU, torch.bfloat16):
        assert (a @ a).dtype == torch.bfloat16
    with device.precision(CPU, None):
        assert (a @ a).dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_batches_arrive_channels_last_equal_to_the_hosts():
    cuda = torch.device("cuda", 0)
    net = conv_net()
    last = device.place(net, cuda)
    assert last and net[0].weight.is_cuda
    want = list(host_batches(5))
    copies = [(x.copy(), y.copy()) for x, y in want]  # the feed may reuse nothing of these
    got = []
    for x, y in device.BatchFeed(cuda, last)(iter(want)):
        assert x.is_cuda and x.is_contiguous(memory_format=torch.channels_last)
        with device.precision(cuda, torch.bfloat16):
            assert net(x).dtype == torch.bfloat16
        got.append((x.float().cpu().numpy(), y.cpu().numpy()))
    torch.cuda.synchronize()
    for (x, y), (wx, wy) in zip(got, copies):
        assert np.array_equal(x, wx) and np.array_equal(y, wy)


def test_torchs_cpu_threads_follow_the_mask_and_the_ranks_sharing_it():
    from mpi4py import MPI

    cores = len(os.sched_getaffinity(0))
    before = torch.get_num_threads()
    try:
        assert device.use_cpu_threads(MPI.COMM_SELF, env={}) == cores
        assert torch.get_num_threads() == cores
        assert device.use_cpu_threads(MPI.COMM_SELF, env={"OMP_NUM_THREADS": "1"}) == 1
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
