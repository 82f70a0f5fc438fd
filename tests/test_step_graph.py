"""hpcdl.nn.step_graph: when a step may be a CUDA graph replay, the fallbacks said once, and
(marked gpu) that graph and plain steps give the same parameters."""

import numpy as np
import pytest

from hpcdl import nn
from hpcdl.backend import cupy_or_none, gpu_available
from hpcdl.nn import step_graph
from hpcdl.nn.step import StepParts, train_step
from hpcdl.nn.step_graph import StepGraph


def parts_of(model_name="resnet20", xp=np, graph=None, optimizer="sgd", **kw):
    model = nn.build_model(model_name, (3, 8, 8), 10, seed=2, xp=xp)
    opt = nn.make_optimizer(optimizer, model.params, model.grads, weight_decay=1e-4)
    return StepParts(model, opt, xp, graph=graph, **kw)


def batch(xp=np, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((4, 3, 8, 8)).astype(np.float32)
    return xp.asarray(x), xp.asarray(rng.integers(0, 10, 4))


def test_on_the_cpu_the_step_runs_plainly_bitwise_and_quietly(capsys):
    graphed, plain = parts_of(graph=StepGraph()), parts_of()
    for seed in range(3):
        x, y = batch(seed=seed)
        a, b = train_step(graphed, x, y, 0.1), train_step(plain, x, y, 0.1)
        assert float(a.loss) == float(b.loss)
    np.testing.assert_array_equal(graphed.model.params, plain.model.params)
    assert graphed.graph.why_not(graphed, x) == "not on a GPU" and graphed.graph.graph is None
    assert "CUDA graph" not in capsys.readouterr().err


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"reducer": object()}, "a gradient reducer runs between the backward kernels"),
        (
            {"scaler": nn.precision.LossScaler(on_device=False)},
            "fp16's loss scaler decides on the host",
        ),
        ({"model_name": "cnn"}, "dropout draws its seed on the host"),
    ],
)
def test_what_keeps_a_step_out_of_a_graph(monkeypatch, change, reason):
    monkeypatch.setattr(step_graph, "is_device_array", lambda a: True)
    graph = StepGraph()
    parts = parts_of(graph=graph, **change)
    assert graph.why_not(parts, batch()[0]) == reason


def test_a_failed_capture_falls_back_to_plain_steps_said_once(monkeypatch, capsys):
    """Pretend the batch is on a GPU: the capture cannot work on NumPy arrays and fails."""
    monkeypatch.setattr(step_graph, "is_device_array", lambda a: True)
    graphed, plain = parts_of(graph=StepGraph()), parts_of()
    for seed in range(2):
        x, y = batch(seed=seed)
        train_step(graphed, x, y, 0.1)
        train_step(plain, x, y, 0.1)
    assert graphed.graph.failed and graphed.graph.why_not(graphed, x) == "its capture failed"
    np.testing.assert_array_equal(graphed.model.params, plain.model.params)
    np.testing.assert_array_equal(graphed.model.buffers, plain.model.buffers)
    assert capsys.readouterr().err.count("capture failed") == 1


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a GPU")
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])  # SGD's update in the graph, Adam's after
def test_graph_and_plain_steps_give_the_same_parameters_on_the_gpu(optimizer):
    cp = cupy_or_none()
    graphed = parts_of(xp=cp, graph=StepGraph(), optimizer=optimizer)
    plain = parts_of(xp=cp, optimizer=optimizer)
    for seed in range(4):
        x, y = batch(cp, seed)
        lr = 0.05 / (seed + 1)  # a schedule: the graph reads each step's lr
        a, b = train_step(graphed, x, y, lr), train_step(plain, x, y, lr)
        np.testing.assert_allclose(float(a.loss), float(b.loss), rtol=1e-6)
    assert graphed.graph.graph is not None, "the step was not captured"
    np.testing.assert_allclose(
        cp.asnumpy(graphed.model.params), cp.asnumpy(plain.model.params), rtol=1e-6, atol=1e-6
    )
    np.testing.assert_allclose(
        cp.asnumpy(graphed.model.buffers), cp.asnumpy(plain.model.buffers), rtol=1e-6, atol=1e-6
    )


@pytest.mark.parametrize(("optimizer", "kept_out"), [("sgd", False), ("adam", False)])
def test_fp16_decided_on_the_device_may_be_in_the_graph(monkeypatch, optimizer, kept_out):
    monkeypatch.setattr(step_graph, "is_device_array", lambda a: True)
    graph = StepGraph()
    scaler = nn.precision.LossScaler(on_device=True)
    parts = parts_of(graph=graph, optimizer=optimizer, scaler=scaler)
    reason = graph.why_not(parts, batch()[0])
    assert reason == ("fp16's loss scaler decides on the host" if kept_out else None)


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a GPU")
def test_an_fp16_graph_decides_skip_or_apply_on_the_device_as_the_plain_step():
    cp = cupy_or_none()

    def fp16_parts(graph):
        scaler = nn.precision.LossScaler(init_scale=2.0**30, growth_interval=2, on_device=True)
        model = nn.build_model("resnet20", (3, 8, 8), 10, seed=2, xp=cp)
        model.set_precision("fp16")  # before the optimizer: its buffers are the masters
        opt = nn.make_optimizer("sgd", model.params, model.grads, momentum=0.9)
        return StepParts(model, opt, cp, graph=graph, scaler=scaler)

    graphed, plain = fp16_parts(StepGraph()), fp16_parts(None)
    applied = []
    for seed in range(6):
        x, y = batch(cp, seed)
        a, b = train_step(graphed, x, y, 0.05), train_step(plain, x, y, 0.05)
        applied.append((bool(a.applied), bool(b.applied)))
    assert graphed.graph.graph is not None, "the step was not captured"
    assert all(a == b for a, b in applied) and (False, False) in applied
    assert graphed.scaler.state_dict() == plain.scaler.state_dict()
    np.testing.assert_allclose(
        cp.asnumpy(graphed.model.params), cp.asnumpy(plain.model.params), rtol=1e-6, atol=1e-6
    )
