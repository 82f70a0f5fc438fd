"""A float64 model with --gpu-kernels keeps float64: logits and every gradient of one training
step agree with NumPy's float64 step to 1e-9 relative (issue 60's correctness goal). On a GPU
with CuPy and cuDNN's frontend; on CPU the same kernels run through the stand-in cuDNN
(tests/fake_cudnn.py), which computes a DOUBLE graph in float64 and refuses memory of another
dtype than the one declared."""

import fake_cudnn
import numpy as np
import pytest

from hpcdl import nn
from hpcdl.backend import cupy_or_none, gpu_available
from hpcdl.nn import kernels
from hpcdl.nn.kernels import cudnn_graphs

MODELS = [("cnn", (3, 16, 16)), ("resnet20", (3, 16, 16))]


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


def one_step(name, shape, xp, with_kernels):
    """(logits, grads, layout) of one float64 training step on xp, dropout off, as NumPy."""
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((8, *shape)), rng.integers(0, 10, 8)
    model = nn.build_model(name, shape, 10, seed=0, xp=xp, dtype=np.float64)
    for leaf in model.body.leaves():
        if isinstance(leaf, nn.layers.Dropout):
            leaf.rate = 0.0
    kernels.enable(with_kernels)
    try:
        logits = model.forward(xp.asarray(x), train=True)
        model.backward(nn.softmax_cross_entropy(logits, xp.asarray(y))[1])
    finally:
        kernels.enable(False)
    host = (lambda a: a) if xp is np else xp.asnumpy
    return host(logits), host(model.grads), model.layout()


def assert_same_step(fast, ref):
    """Logits and each parameter's gradient within 1e-9 relative; a failure names the worst."""
    (logits, grads, layout), (logits_ref, grads_ref, _) = fast, ref
    assert logits.dtype == np.float64 and grads.dtype == np.float64
    worst = sorted(
        (_rel(grads[o : o + int(np.prod(s))], grads_ref[o : o + int(np.prod(s))]), n)
        for n, s, o in layout
        if np.abs(grads_ref[o : o + int(np.prod(s))]).max() > 0
    )[-3:]
    assert _rel(logits, logits_ref) < 1e-9, worst
    assert worst[-1][0] < 1e-9, worst


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a GPU")
@pytest.mark.parametrize(("name", "shape"), MODELS)
def test_the_float64_step_with_the_kernels_matches_numpy(name, shape):
    """CuPy with --gpu-kernels (cuDNN graphs where cuDNN has a DOUBLE plan, the layer's own
    float64 kernels where it has none) against NumPy float64."""
    assert cudnn_graphs.runtime() is not None, "nvidia-cudnn-frontend is not usable here"
    fast = one_step(name, shape, cupy_or_none(), with_kernels=True)
    assert_same_step(fast, one_step(name, shape, np, with_kernels=False))


@pytest.fixture
def stand_in(monkeypatch):
    return fake_cudnn.install(monkeypatch, fake_cudnn.Module())


@pytest.mark.parametrize(("name", "shape"), MODELS)
def test_the_float64_step_with_the_stand_in_kernels_matches_numpy(stand_in, name, shape):
    """The CPU twin: the convolutions run cuDNN graphs declared DOUBLE (never float32), and
    BatchNorm, which cuDNN has no float64 engine for, runs its own float64 kernel."""
    fast = one_step(name, shape, np, with_kernels=True)
    assert_same_step(fast, one_step(name, shape, np, with_kernels=False))
    declared = {g.options["io_data_type"].value for g in stand_in.graphs}
    ops = {outs[0].op for g in stand_in.graphs for outs in g.ops}
    assert stand_in.executions > 0 and declared == {"DOUBLE"}, declared
    assert ops == {"conv_fprop", "conv_dgrad", "conv_wgrad"}, ops


def test_a_float64_convolution_cuDNN_refuses_runs_the_layers_float64_code(monkeypatch, capsys):
    """No DOUBLE plan for a shape: that layer's own float64 code runs (said once), never the
    op's float32 plan as a half format's would."""
    module = fake_cudnn.install(monkeypatch, fake_cudnn.Module(lambda op, dims, dt: dt == "DOUBLE"))
    fast = one_step("cnn", (3, 16, 16), np, with_kernels=True)
    assert_same_step(fast, one_step("cnn", (3, 16, 16), np, with_kernels=False))
    assert module.executions == 0
    said = [line for line in capsys.readouterr().err.splitlines() if "float64" in line]
    assert said and all("runs hpcdl's own kernels" in line for line in said), said
