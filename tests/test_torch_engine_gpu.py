"""The torch engine's device path (hpcdl/torch_engine/device.py): on the CPU the feed is a
no-copy view, channels_last and autocast follow the device; on a GPU (marked, skips without
CUDA) the batches arrive pinned-then-copied on their own stream, equal to the host's, and
--decode gpu's CuPy batches become tensors on the step's stream, equal to the decoder's."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from helpers import run_train

from hpcdl import checkpoint

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
    net = conv_net().to(cuda)
    last = device.use_channels_last(net, cuda)
    assert last
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


class PillowOntoCupy:
    """A decoder that hands back CuPy arrays, as nvImageCodec does (Pillow, then a copy)."""

    name = "pillow-cupy"

    def decode(self, blobs, stream=None):
        import cupy  # noqa: PLC0415

        from hpcdl.data.gpu_decode import pillow_decode  # noqa: PLC0415

        return [cupy.asarray(pillow_decode(b)) for b in blobs]


def byte_slots(ds, order):
    """The workers' byte slots of each batch: ((offsets, data), labels)."""
    from hpcdl.data.file_bytes import FileBytesReader, byte_capacity  # noqa: PLC0415

    reader = FileBytesReader(ds)
    for indices in order:
        offsets = np.empty(len(indices) + 1, np.int64)
        data = np.empty(byte_capacity(ds, len(indices)), np.uint8)
        labels = np.empty(len(indices), np.int64)
        reader.read(indices, labels, offsets, data)
        yield (offsets, data), labels


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("labels_on", ["cupy", "numpy"])
def test_on_a_gpu_decoded_cupy_batches_become_tensors_on_the_steps_stream(
    tmp_path, channels_last, labels_on
):
    """--decode gpu: the decoder's thread builds each batch on its side stream one ahead; the
    feed takes it on torch's current stream (device.py's module notes) as tensors of the
    CuPy arrays (DLPack), labels NumPy or CuPy, equal to the same batches built in place."""
    cupy = pytest.importorskip("cupy")
    from helpers import make_folder  # noqa: PLC0415

    from hpcdl.data import open_dataset  # noqa: PLC0415
    from hpcdl.data.augment import parse_augment  # noqa: PLC0415
    from hpcdl.data.gpu_decode import GpuBatchDecoder  # noqa: PLC0415

    make_folder(tmp_path / "imgs", per_class=16, size=(40, 40), fmt="jpg")
    ds = open_dataset(tmp_path / "imgs")
    order = [np.arange(k, k + 8) for k in range(0, len(ds), 8)]
    cuda = torch.device("cuda", 0)
    torch.cuda.set_device(cuda)
    cupy.cuda.Device(0).use()

    def decoder():
        return GpuBatchDecoder(ds, parse_augment("rrc24+flip"), 3, cupy, PillowOntoCupy())

    want = []
    for ((offsets, data), labels), b in zip(byte_slots(ds, order), order):
        x, y = decoder().build(b, offsets, data, labels, 0)
        want.append((cupy.asnumpy(x), cupy.asnumpy(y)))
    decoded = decoder().ahead(order, byte_slots(ds, order), 0, True)
    if labels_on == "numpy":  # images CuPy, labels NumPy: each array by what it is
        decoded = ((x, cupy.asnumpy(y)) for x, y in decoded)
    got = []
    layout = torch.channels_last if channels_last else torch.contiguous_format
    for x, y in device.BatchFeed(cuda, channels_last)(decoded, decoded=True):
        assert x.device == cuda and y.device == cuda and y.dtype == torch.int64
        assert x.is_contiguous(memory_format=layout)
        got.append(((x * 1).cpu().numpy(), y.cpu().numpy()))  # a kernel on the step's stream
    assert len(got) == len(want) == len(order)
    for (x, y), (wx, wy) in zip(got, want):
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


MODEL = f"{Path(__file__).parent / 'torch_models.py'}:small_cnn"


def args(digits: Path, *more) -> list:
    """tests/test_torch_engine.py's run: its small CNN on the digits data."""
    return ["--data", digits / "train", "--model", MODEL, "--batch-size", 16, "--lr", 0.05,
            "--workers", 0, "--seed", 3, "--progress", "none", *more]  # fmt: skip


def test_a_rank_trains_on_the_cuda_device_of_its_local_rank_modulo_the_visible_ones():
    """As hpcdl.backend.select binds CuPy, so torch, CuPy and the reducer share one device."""
    assert [device.cuda_index(rank, 4) for rank in range(6)] == [0, 1, 2, 3, 0, 1]
    assert [device.cuda_index(rank, 1) for rank in range(3)] == [0, 0, 0]


def test_device_cpu_is_the_host_and_binds_nothing():
    assert device.torch_device("cpu", "m.py:f", 3) == (CPU, None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the line for a torch without CUDA")
def test_device_gpu_where_torch_sees_no_cuda_is_one_line_naming_the_way_out():
    where, line = device.torch_device("gpu", "m.py:f", 0)
    assert where == CPU and line is not None and "\n" not in line
    assert line.startswith("--device gpu with a torch model (--model m.py:f) needs a CUDA")
    assert "torch.cuda.is_available() is False" in line and "--device cpu" in line


def test_device_gpu_is_no_longer_refused_for_a_torch_model():
    from hpcdl.config import TrainConfig  # noqa: PLC0415
    from hpcdl.torch_engine.specs import refused  # noqa: PLC0415

    assert refused(TrainConfig(data="x", model="m.py:f", device="gpu")) is None
    assert "--gpu-kernels" in refused(TrainConfig(data="x", model="m.py:f", gpu_kernels=True))


def test_device_gpu_without_a_gpu_stops_every_rank_with_one_line(digits_dir):
    """Here CuPy's start-up check (no CuPy, or no GPU) or the engine's (torch without CUDA)
    says why; either way one line, no traceback, no hang."""
    done = run_train(2, *args(digits_dir, "--epochs", 1, "--device", "gpu"), timeout=120)
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("hpcdl.train: error")]
    assert len(errors) == 1, done.stderr
    line = errors[0]
    assert "--device gpu" in line and "--device cpu" in line, line


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_two_steps_on_cuda_end_near_the_same_two_steps_on_the_cpu(digits_dir, tmp_path):
    """2 ranks, gradients averaged by the reducer on device buffers (or staged through pinned
    memory), a checkpoint of CPU copies after step 1 resumed onto the device for step 2: the
    parameters within float32 tolerance of 2 uninterrupted steps on the CPU."""

    def train(where: str, ckpt: Path, steps: int, *more) -> checkpoint.Checkpoint:
        done = run_train(2, *args(digits_dir, "--epochs", 1, "--max-steps", steps, "--device",
                                  where, "--checkpoint-every", 1, "--checkpoint-dir", ckpt,
                                  *more), timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        return checkpoint.load(checkpoint.latest(ckpt))

    cpu = train("cpu", tmp_path / "cpu", 2)
    first = train("gpu", tmp_path / "gpu", 1)
    assert isinstance(first.params, np.ndarray) and not np.array_equal(first.params, cpu.params)
    gpu = train("gpu", tmp_path / "gpu", 2, "--resume", "auto")
    np.testing.assert_allclose(gpu.params, cpu.params, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(gpu.buffers, cpu.buffers, rtol=1e-4, atol=1e-5)


def test_tf32_sets_torchs_float32_convolutions_and_matmuls_alike():
    """--tf32 (NOTE [TF32]): torch's float32 convolutions, RNNs and matmuls on TF32 tensor
    cores, else IEEE float32, through the fp32_precision settings; `--tf32` parses to it, and
    the torch engine serves it."""
    from hpcdl.config import TrainConfig, build_parser  # noqa: PLC0415
    from hpcdl.torch_engine.specs import refused  # noqa: PLC0415

    backends = (torch.backends.cudnn.conv, torch.backends.cudnn.rnn, torch.backends.cuda.matmul)
    saved = [b.fp32_precision for b in backends]
    try:
        for tf32, value in ((True, "tf32"), (False, "ieee")):
            assert device.set_fp32_precision(tf32) == value
            assert [b.fp32_precision for b in backends] == [value] * 3
    finally:
        for backend, value in zip(backends, saved, strict=True):
            backend.fp32_precision = value
    assert build_parser().parse_args(["--data", "x", "--tf32"]).tf32 is True
    assert refused(TrainConfig(data="x", model="m.py:f", tf32=True)) is None
