"""Real half arrays between layers (hpcdl.nn.dtypes, Model.set_precision(real=True)): every
activation and input gradient that crosses a layer boundary is a bf16/fp16 array, the masters,
gradients and optimizer state stay float32, and the step's numbers are the emulated path's
within the format's tolerance. On NumPy through ml_dtypes: the dtype logic CuPy runs."""

import numpy as np
import pytest

from hpcdl import nn
from hpcdl.nn import dtypes

ml_dtypes = pytest.importorskip("ml_dtypes")  # in the test and gpu extras

# (model, input shape): dense + dropout; conv + pool + dropout + flatten; BatchNorm, the
# residual add (option A) and the global average pool; bottleneck blocks with option B.
MODELS = [("mlp", (3, 6, 6)), ("cnn", (3, 12, 12)), ("resnet20", (3, 8, 8))]
# Relative error of a step's logits and gradients against the emulated path: a few roundings
# of the format (bf16 2^-8, fp16 2^-11) where the two round in a different order.
TOLERANCE = {"bf16": 3e-2, "fp16": 4e-3}


def watch_boundaries(model):
    """Record the dtype of every array a leaf layer returns, forward and backward."""
    seen = []
    for leaf in model.body.leaves():
        forward, backward = leaf.forward, leaf.backward

        def watched_forward(x, *args, _f=forward, _leaf=leaf, **kwargs):
            y = _f(x, *args, **kwargs)
            seen.append((type(_leaf).__name__, "forward", x.dtype, y.dtype))
            return y

        def watched_backward(dy, *args, _b=backward, _leaf=leaf, **kwargs):
            dx = _b(dy, *args, **kwargs)
            out = None if dx is None else dx.dtype
            seen.append((type(_leaf).__name__, "backward", dy.dtype, out))
            return dx

        leaf.forward, leaf.backward = watched_forward, watched_backward
    return seen


def step(name, shape, precision, real):
    """One forward, backward and SGD step; (model, optimizer, logits, loss, gradients)."""
    model = nn.build_model(name, shape, 10, seed=3)
    model.set_precision(precision, real=real)
    opt = nn.make_optimizer("sgd", model.params, model.grads, momentum=0.9)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, *shape)).astype(np.float32)
    labels = rng.integers(0, 10, 4)
    seen = watch_boundaries(model)
    logits = model.forward(x)
    loss, dlogits = nn.softmax_cross_entropy(logits, labels)
    model.backward(dlogits)
    grads = model.grads.copy()
    opt.step(0.1)
    return model, opt, logits, loss, grads, seen


def relative(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.parametrize("gpu_kernels", [False, True], ids=["reference", "gpu-kernels"])
@pytest.mark.parametrize(("name", "shape"), MODELS)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_activations_and_their_gradients_are_half_arrays_between_layers(
    monkeypatch, name, shape, precision, gpu_kernels
):
    """With the fast kernels on, those that run on NumPy (Philox dropout) and the containers'
    fusion attempts keep the format too."""
    monkeypatch.setattr(nn.kernels, "_enabled", gpu_kernels)
    half = dtypes.half_dtype(precision)
    model, opt, logits, loss, _, seen = step(name, shape, precision, real=True)
    assert model.dtypes.real and model.dtypes.activations == half
    crossings = [entry for entry in seen if entry[3] is not None]
    assert len(crossings) > len(list(model.body.leaves()))  # forward and backward, watched
    wrong = [entry for entry in crossings if entry[2] != half or entry[3] != half]
    assert not wrong, f"float32 between layers: {wrong}"
    assert logits.dtype == np.float32 and np.asarray(loss).dtype == np.float32  # sums: float32
    for array in (model.params, model.grads, opt.velocity, model.buffers):
        assert array.dtype == np.float32


@pytest.mark.parametrize(("name", "shape"), MODELS)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_real_half_arrays_give_the_emulated_step_within_the_formats_tolerance(
    name, shape, precision
):
    _, _, real_logits, real_loss, real_grads, _ = step(name, shape, precision, real=True)
    model, _, logits, loss, grads, seen = step(name, shape, precision, real=False)
    assert {entry[3] for entry in seen} <= {np.dtype(np.float32), None}  # emulated: float32
    tol = TOLERANCE[precision]
    assert relative(real_logits, logits) < tol
    assert abs(float(real_loss) - float(loss)) < tol * abs(float(loss))
    # Max pooling picks one input per window: where the two paths round a near tie apart,
    # the gradient moves to another input (cnn: ~10 % of the norm, fp16). So with pools, the
    # gradients compared are those of the layers after the last pool.
    compared = [(o, o + int(np.prod(s))) for n, s, o in model.layout() if ".Conv2d." not in n]
    if name != "cnn":
        compared = [(0, grads.size)]
    for first, end in compared:
        assert relative(real_grads[first:end], grads[first:end]) < 2 * tol


def test_numpy_stays_emulated_unless_asked_even_with_the_fast_kernels(monkeypatch):
    monkeypatch.setattr(nn.kernels, "_enabled", True)
    model = nn.build_model("mlp", (3, 6, 6), 10)
    model.set_precision("bf16")
    assert not model.dtypes.real and model.dtypes.activations == np.float32
    fp32 = nn.build_model("mlp", (3, 6, 6), 10)
    fp32.set_precision("fp32", real=True)
    assert not fp32.dtypes.real
