"""hpcdl.bench.torch_models: the PyTorch ResNets `bench compute` times against (needs torch)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hpcdl import nn
from hpcdl.nn.weights_io import state_dict

torch = pytest.importorskip("torch")
from hpcdl.bench import torch_models  # noqa: E402 (imports torch)


def count(module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("name,params", [("resnet18", 11_689_512), ("resnet50", 25_557_032)])
def test_parameter_counts_are_torchvisions(name, params):
    """torchvision.models.resnet18/50(num_classes=1000): sum(p.numel() for p in parameters())."""
    model = torch_models.imagenet_resnet(name, 3, 1000)
    assert count(model) == params
    bns = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert sum(b.running_mean.numel() + b.running_var.numel() for b in bns) > 0  # buffers


@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_same_parameter_arrays_as_hpcdls_model(name):
    """The same arrays, array by array (sizes; hpcdl stores kernels in another axis order)."""
    ours = nn.build_model(name, (1, 32, 32), 7, seed=0)
    theirs = torch_models.imagenet_resnet(name, 1, 7)
    ours_sizes = sorted(int(np.prod(shape)) for _, shape, _ in ours.layout())
    assert sorted(p.numel() for p in theirs.parameters()) == ours_sizes
    convs = [m for m in theirs.modules() if isinstance(m, torch.nn.Conv2d)]
    assert len(convs) == (20 if name == "resnet18" else 53)
    assert (convs[0].kernel_size, convs[0].stride, convs[0].padding) == ((7, 7), (2, 2), (3, 3))


def test_forward_and_backward_give_logits_and_gradients():
    model = torch_models.imagenet_resnet("resnet18", 3, 5)
    x = torch.randn(2, 3, 48, 40)
    logits = model(x)
    assert tuple(logits.shape) == (2, 5)
    torch.nn.functional.cross_entropy(logits, torch.tensor([0, 4])).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_unknown_name_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown ResNet 'resnet34'"):
        torch_models.imagenet_resnet("resnet34")


def test_bench_compute_reports_a_ratio_for_the_imagenet_resnets(capsys):
    from hpcdl.bench import compute  # noqa: PLC0415

    argv = ["--model", "resnet18", "--batch-size", "2", "--input-shape", "3,16,16", "--steps", "1"]
    assert compute.main([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["torch_ms_per_step"] > 0 and result["ratio"] > 0


@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_same_logits_as_hpcdl_with_hpcdls_weights(name):
    """float64, training mode (batch statistics): strides, paddings and order agree (ResNet v1,
    the stride on the first 1x1, gives O(1) differences). 64x64, batch 4: stage 4 is 2x2, so its
    BatchNorms see 16 values a channel (2 values at 32x32, batch 2, amplify rounding to ~1e-7)."""
    ours = nn.build_model(name, (3, 64, 64), 5, seed=1, dtype=np.float64)
    theirs = torch_models.imagenet_resnet(name, 3, 5).double()
    # hpcdl's name map (hpcdl.nn.weight_names): torchvision's keys, every one of them
    state = {k: torch.from_numpy(v) for k, v in state_dict(ours).items()}
    theirs.load_state_dict(state, strict=True)
    x = np.random.default_rng(0).standard_normal((4, 3, 64, 64))
    expected = ours.forward(x, train=True)
    got = theirs.train()(torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-9 * np.abs(expected).max())
