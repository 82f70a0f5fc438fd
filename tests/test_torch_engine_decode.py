"""`--decode gpu` with a torch model (hpcdl/torch_engine/device.py's module notes): the loader's
workers read file bytes, the rank decodes each batch (Pillow on the CPU here, as in
tests/test_gpu_decode.py) and the torch engine trains on those batches as tensors. The GPU
half (CuPy batches through DLPack) is tests/test_torch_engine_gpu.py's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import make_folder, read_events, run_train

from hpcdl import checkpoint

torch = pytest.importorskip("torch")

from hpcdl.torch_engine import device  # noqa: E402

CNN = f"{Path(__file__).parent / 'torch_models.py'}:small_cnn"


def test_on_the_cpu_decoded_batches_are_handed_on_without_a_copy():
    rng = np.random.default_rng(0)
    want = [(rng.random((4, 3, 8, 8), np.float32), rng.integers(0, 10, 4)) for _ in range(3)]
    got = list(device.BatchFeed(torch.device("cpu"))(iter(want), decoded=True))
    assert len(got) == len(want)
    for (x, y), (wx, wy) in zip(got, want):
        assert x.data_ptr() == wx.ctypes.data and y.data_ptr() == wy.ctypes.data
        assert x.dtype == torch.float32 and y.dtype == torch.int64


def test_decode_gpu_trains_a_torch_model_as_decode_cpu_does(tmp_path):
    """2 ranks, a user's nn.Module, a JPEG folder with --augment: --decode gpu (Pillow in the
    rank) trains every step and says how it decodes, as hpcdl's engine's test asserts
    (tests/test_gpu_decode.py). Not bitwise --decode cpu's parameters: the two paths'
    normalised pixels differ in the last bit (float order), as they do for hpcdl's engine;
    the parameters end within float32 noise of them."""
    folder = tmp_path / "imgs"
    make_folder(folder, per_class=24, size=(20, 20), fmt="jpg")
    common = ["--data", folder, "--model", CNN, "--augment", "rcrop16+flip", "--epochs", 2,
              "--batch-size", 4, "--workers", 1, "--seed", 3, "--progress", "none"]  # fmt: skip
    ends = {}
    for decode in ("cpu", "gpu"):
        metrics = tmp_path / f"{decode}.jsonl"
        done = run_train(2, *common, "--decode", decode, "--checkpoint-dir", tmp_path / decode,
                         "--metrics", metrics, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        assert ("files decoded in the rank (pillow)" in done.stdout) == (decode == "gpu")
        (summary,) = read_events(metrics, "summary")
        assert summary["steps"] == 2 * 48 // (2 * 4) and np.isfinite(summary["train_loss"])
        ends[decode] = checkpoint.load(checkpoint.latest(tmp_path / decode))
    cpu, gpu = ends["cpu"], ends["gpu"]
    assert cpu.global_step == gpu.global_step == 12
    np.testing.assert_allclose(gpu.params, cpu.params, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(gpu.buffers, cpu.buffers, rtol=1e-4, atol=1e-5)
