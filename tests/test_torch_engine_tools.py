"""The tools with a torch model (hpcdl.torch_engine): hpcdl.export of a torch engine's
checkpoint, and the flags the torch engine serves or refuses; real runs on the digits data."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import run_train

from hpcdl import checkpoint

torch = pytest.importorskip("torch")

MODELS = Path(__file__).parent / "torch_models.py"
CNN = f"{MODELS}:small_cnn"


def args(digits: Path, *more) -> list:
    return ["--data", digits / "train", "--model", CNN, "--batch-size", 16, "--lr", 0.05,
            "--workers", 0, "--seed", 3, "--progress", "none", *more]  # fmt: skip


@pytest.fixture(scope="module")
def torch_ckpt(digits_dir, tmp_path_factory) -> Path:
    """The last checkpoint of a short torch-engine run of small_cnn (BatchNorm: buffers)."""
    ck = tmp_path_factory.mktemp("torch-ck")
    done = run_train(1, *args(digits_dir, "--epochs", 1, "--max-steps", 12,
                              "--checkpoint-every", 12, "--checkpoint-dir", ck),
                     timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return checkpoint.latest(ck)


def export(*argv) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hpcdl.export", *map(str, argv)],
        capture_output=True,
        text=True,
        timeout=300,
    )


def user_module(ckpt: Path) -> torch.nn.Module:
    """The user's own module, built from their file as they would, untrained."""
    import torch_models  # noqa: PLC0415 (tests/ is on the path)

    return torch_models.small_cnn((1, 8, 8), 10).eval()


def test_export_to_torch_is_the_state_dict_the_users_module_loads_strictly(torch_ckpt, tmp_path):
    out = tmp_path / "cnn.pth"
    done = export(torch_ckpt, "--to", "torch", out)
    assert done.returncode == 0, done.stderr
    assert "wrote" in done.stdout and "10 classes" in done.stdout
    state = torch.load(out, weights_only=True)
    module = user_module(torch_ckpt)
    assert set(state) == set(module.state_dict())  # parameters AND buffers
    module.load_state_dict(state, strict=True)
    saved = checkpoint.load(torch_ckpt)
    assert int(state["norm.num_batches_tracked"]) == saved.global_step == 12
    assert not torch.equal(state["norm.running_mean"], torch.zeros(8))  # trained statistics
    flat = dict(zip([n for n, _ in saved.layout], np.cumsum([0] + [int(np.prod(s)) for _, s
                                                                   in saved.layout])))  # fmt: skip
    lo = int(flat["head.bias"])
    assert state["head.bias"].numpy().tobytes() == saved.params[lo : lo + 10].tobytes()
    again = export(torch_ckpt, "--to", "torch", out)  # never replaces a file
    assert again.returncode == 2 and "exists" in again.stderr and "Traceback" not in again.stderr


def test_export_to_safetensors_holds_the_same_tensors(torch_ckpt, tmp_path):
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file  # noqa: PLC0415

    done = export(torch_ckpt, "--to", "safetensors", tmp_path / "cnn.safetensors")
    assert done.returncode == 0, done.stderr
    module = user_module(torch_ckpt)
    module.load_state_dict(load_file(tmp_path / "cnn.safetensors"), strict=True)
    pth = tmp_path / "cnn.pth"
    assert export(torch_ckpt, "--to", "torch", pth).returncode == 0
    reference = torch.load(pth, weights_only=True)
    for key, tensor in module.state_dict().items():
        assert torch.equal(tensor, reference[key]), key


def test_export_to_onnx_computes_the_torch_modules_logits(torch_ckpt, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    out, pth = tmp_path / "cnn.onnx", tmp_path / "cnn.pth"
    done = export(torch_ckpt, "--to", "onnx", out)
    assert done.returncode == 0, done.stderr
    assert export(torch_ckpt, "--to", "torch", pth).returncode == 0
    module = user_module(torch_ckpt)
    module.load_state_dict(torch.load(pth, weights_only=True), strict=True)
    x = torch.randn(5, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = module(x).numpy()
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
