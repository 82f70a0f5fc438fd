"""hpcdl.nn.onnx_export: every built-in model and a user's model, run by onnxruntime on CPU,
give hpcdl's evaluation-mode logits to 1e-4."""

from __future__ import annotations

import numpy as np
import pytest

from hpcdl import nn
from hpcdl.nn.onnx_export import to_onnx
from hpcdl.nn.weights_io import state_dict

ort = pytest.importorskip("onnxruntime")


def trained_like(model: nn.Model, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for leaf in model.body.leaves():
        if "running_mean" in leaf.b:
            leaf.b["running_mean"][...] = rng.normal(0, 0.2, leaf.b["running_mean"].shape)
            leaf.b["running_var"][...] = rng.uniform(0.5, 1.5, leaf.b["running_var"].shape)


def onnx_logits(model: nn.Model, x: np.ndarray) -> np.ndarray:
    proto = to_onnx(model, state_dict(model))
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(["logits"], {"input": x})[0]


@pytest.mark.parametrize(
    "name,shape",
    [
        ("mlp", (3, 8, 8)),
        ("cnn", (3, 32, 32)),  # Flatten of 6x6x64: the dense rows in PyTorch's order
        ("cnn", (1, 8, 8)),
        ("resnet20", (3, 16, 16)),  # option-A shortcuts: Slice + Pad
        ("resnet18", (3, 32, 32)),
        ("resnet50", (3, 32, 32)),
        ("examples/my_model.py:build", (1, 8, 8)),  # a user's model of hpcdl.nn layers
    ],
)
def test_onnxruntime_gives_hpcdls_logits(name, shape):
    model = nn.build_model(name, shape, 5, seed=1)
    trained_like(model, 2)
    x = np.random.default_rng(3).standard_normal((3, *shape)).astype(np.float32)
    expected = model.forward(x, train=False)
    got = onnx_logits(model, x)
    assert got.shape == (3, 5)
    assert np.ptp(expected, axis=0).max() > 1e-6  # the samples differ: the graph sees the input
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


def test_batch_size_is_free_and_weights_are_named_by_state_dict_key():
    model = nn.build_model("resnet20", (3, 8, 8), 10, seed=0)
    proto = to_onnx(model, state_dict(model))
    names = {init.name for init in proto.graph.initializer}
    assert set(state_dict(model)) - names == {
        k for k in state_dict(model) if k.endswith("num_batches_tracked")
    }
    x = np.zeros((7, 3, 8, 8), np.float32)
    assert onnx_logits(model, x).shape == (7, 10)


class Square(nn.Layer):
    def forward(self, x, train=True):
        return x * x


def test_a_layer_without_an_onnx_form_is_one_error_naming_it():
    model = nn.Model("sq", [nn.Flatten(), Square(), nn.Linear(12, 2)], (3, 2, 2), 2)
    with pytest.raises(ValueError, match=r"^layer Square has no ONNX form; an exported model"):
        to_onnx(model, state_dict(model))
