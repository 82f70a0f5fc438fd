"""Which cuDNN engine a plan runs (NOTE [cuDNN graphs], NOTE [engine autotuning]): the first of
the heuristics' ranked list that builds and that no note filter left out, named; with
HPCDL_CUDNN_AUTOTUNE=K a convolution's first K timed on its first run outside a capture and the
fastest kept. On CPU, with the stand-in frontend's ranked engine list (tests/fake_cudnn.py)."""

import subprocess
import sys

import numpy as np
import pytest
from fake_cudnn import Engine, Graph, Module, install

from hpcdl import nn
from hpcdl.backend import cupy_or_none, gpu_available
from hpcdl.nn import kernels
from hpcdl.nn.kernels import batchnorm as bn_kernels
from hpcdl.nn.kernels import conv as conv_kernels
from hpcdl.nn.kernels import cudnn_graphs


def engines():
    """A ranked list as cuDNN's heuristics give one for a float32 convolution: a TF32 tensor-core
    engine first, one that does not build for the shape, then IEEE engines slow to fast."""
    return [
        Engine("tf32_tensor_core", notes={"TENSOR_CORE"}, ms=0.2),
        Engine("no_build", builds=False, ms=0.1),
        Engine("ieee_a", ms=3.0),
        Engine("ieee_b", ms=1.0, workspace=4096),
        Engine("ieee_c", ms=2.0),
        Engine("ieee_d", ms=0.5),
    ]


@pytest.fixture
def fake(monkeypatch):
    return install(monkeypatch, Module(engines=engines()), batch_norm=False, enable=True)


def conv_step(c_in=3, c_out=4, seed=0):
    """A Conv2d's forward and backward on a random batch; (layer, y, dx, dW)."""
    conv = nn.Conv2d(c_in, c_out, 3, padding=1)
    nn.Model("c", [conv], (c_in, 9, 9), 10, seed=4)
    conv.input_grad = True  # a first layer computes none: the data gradient's plan too
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 9, 9, c_in)).astype(np.float32)
    y = conv.forward(x)
    dx = conv.backward(rng.standard_normal(y.shape).astype(np.float32))
    return conv, y, dx, conv.g["W"].copy()


def plans():
    """The conv kernel's plans by operation."""
    cache = conv_kernels.KERNELS[0].cache
    return {key.op: plan for key, plan in cache._plans.items()}


def test_a_plan_runs_the_first_engine_that_builds_and_no_filter_left_out(fake, monkeypatch):
    """float32: the TF32 engine is left out (NOTE [TF32]), the next does not build, so every
    op runs ieee_a, the third; with --tf32 the first."""
    conv_step()
    assert {op: p.name for op, p in plans().items()} == dict.fromkeys(
        ("conv_fprop", "conv_wgrad", "conv_dgrad"), "ieee_a"
    )
    assert {p.index for p in plans().values()} == {2}
    assert set(fake.runs) == {"ieee_a"} and not any(p.timed_ms for p in plans().values())
    report = cudnn_graphs.plan_report(("conv",), each=True)
    assert (report["plans"], report["engines"], report["timed"]) == (3, {"ieee_a": 3}, 0)
    assert sorted(line.split()[0] for line in report["each"]) == sorted(plans())
    assert all(line.endswith(": ieee_a") for line in report["each"])
    monkeypatch.setattr(kernels, "_tf32", True)
    fake.runs.clear()
    conv_step()
    assert set(fake.runs) == {"tf32_tensor_core"}


def test_autotune_times_the_first_k_engines_that_build_and_keeps_the_fastest(fake, monkeypatch):
    """K=3: ieee_a, ieee_b and ieee_c are timed (not ieee_d, the fourth that builds); ieee_b is
    the fastest of them and runs from then on; the numbers are the heuristics' choice's."""
    _, y_ref, dx_ref, dw_ref = conv_step()
    monkeypatch.setattr(kernels, "_autotune", 3)
    fake.runs.clear()
    _, y, dx, dw = conv_step()
    for plan in plans().values():
        if plan.timed_ms:
            assert plan.timed_ms == {2: 3.0, 3: 1.0, 4: 2.0}
            assert (plan.index, plan.name, plan.workspace_bytes) == (3, "ieee_b", 4096)
    assert len([p for p in plans().values() if p.timed_ms]) == 3  # the three ops, tuned anew
    # each op: every engine once and 3 timed runs, then its run on ieee_b
    assert fake.runs.count("ieee_a") == fake.runs.count("ieee_c") == 3 * 4
    assert fake.runs.count("ieee_b") == 3 * 5 and "ieee_d" not in fake.runs
    fake.runs.clear()
    conv_step()
    assert fake.runs == ["ieee_b"] * 3  # tuned once per plan
    report = cudnn_graphs.plan_report(("conv",))  # the untuned plans of the first step, too
    assert report["engines"] == {"ieee_a": 3, "ieee_b": 3} and report["timed"] == 3
    assert (report["changed"], report["first_ms"], report["chosen_ms"]) == (3, 9.0, 3.0)
    for got, want in ((y, y_ref), (dx, dx_ref), (dw, dw_ref)):
        np.testing.assert_array_equal(got, want)


def test_autotune_leaves_out_engines_over_the_workspace_limit(fake, monkeypatch):
    monkeypatch.setattr(kernels, "_autotune", 3)
    monkeypatch.setattr(cudnn_graphs, "TUNE_WORKSPACE_BYTES", 1024)  # ieee_b asks for 4096
    conv_step()
    assert {p.name for p in plans().values()} == {"ieee_c"}
    assert all(set(p.timed_ms) == {2, 4} for p in plans().values())


def test_autotune_times_nothing_in_a_capture_and_tunes_at_the_next_plain_run(fake, monkeypatch):
    """A CUDA graph capture cannot time (nor sync): the heuristics' engine is captured; the
    next run outside a capture times them."""
    monkeypatch.setattr(kernels, "_autotune", 3)
    fake.capturing = True
    conv_step()
    assert set(fake.runs) == {"ieee_a"} and all(p.untimed for p in plans().values())
    fake.capturing = False
    conv_step()
    assert {p.name for p in plans().values()} == {"ieee_b"}
    assert not any(p.untimed for p in plans().values())


def test_a_timing_that_fails_keeps_the_heuristics_engine_said_once(fake, monkeypatch, capsys):
    """Where the timing itself fails (the frontend's workspace query, say), the step goes on
    with the heuristics' engine, in one line."""
    monkeypatch.setattr(kernels, "_autotune", 3)

    def broken(self, index, handle=None):
        raise RuntimeError("no workspace size")

    monkeypatch.setattr(Graph, "get_workspace_size_plan_at_index", broken)
    _, y, dx, dw = conv_step()
    assert {p.name for p in plans().values()} == {"ieee_a"}
    assert not any(p.timed_ms or p.untimed for p in plans().values())
    assert set(fake.runs) == {"ieee_a"}
    err = capsys.readouterr().err
    assert err.count("timing cuDNN's engines failed (RuntimeError: no workspace size)") == 1


def test_batchnorm_graphs_are_never_timed(monkeypatch):
    """BatchNorm's training graph updates its running statistics in place: running it once per
    engine would move them. Its plans keep the heuristics' engine; convolutions are timed."""
    module = install(monkeypatch, Module(engines=engines()), enable=True)
    monkeypatch.setattr(kernels, "_autotune", 3)
    model = nn.build_model("resnet20", (3, 8, 8), 10, seed=1)
    x = np.random.default_rng(2).standard_normal((2, 3, 8, 8)).astype(np.float32)
    model.backward(nn.softmax_cross_entropy(model.forward(x), np.array([1, 7]))[1])
    norm_plans = [p for k in bn_kernels.KERNELS for p in k.cache._plans.values()]
    assert norm_plans and all(not p.timed_ms and p.name == "ieee_a" for p in norm_plans)
    conv = list(conv_kernels.KERNELS[0].cache._plans.values())
    assert conv and all(p.name == "ieee_b" and len(p.timed_ms) == 3 for p in conv)
    assert module.executions > 0


def test_a_graph_whose_every_engine_a_filter_leaves_out_is_refused_and_the_layer_falls_back(
    monkeypatch, capsys
):
    module = Module(engines=[Engine("tf32_only", notes={"TENSOR_CORE"})])
    install(monkeypatch, module, batch_norm=False, enable=True)
    conv, *_ = conv_step()
    assert conv.seam.kernel is None and module.executions == 0
    assert "No valid engine configs" in capsys.readouterr().err


def test_the_stand_ins_ranked_list_refuses_what_the_frontend_refuses(fake):
    """An index out of range, one a filter left out, one that does not build, executing an
    engine not built."""
    conv_step()
    graph = next(iter(plans().values())).graph
    with pytest.raises(IndexError):
        graph.build_plan_at_index(6)
    with pytest.raises(ValueError, match="excluded"):
        graph.build_plan_at_index(0)
    with pytest.raises(fake.cudnnGraphNotSupportedError):
        graph.build_plan_at_index(1)
    with pytest.raises(RuntimeError, match="not built"):
        graph.execute_plan_at_index({}, 0, 5, handle=fake.create_handle())
    assert graph.get_execution_plan_count() == 6 and graph.get_plan_name_at_index(5) == "ieee_d"


@pytest.mark.parametrize(
    ("value", "count", "said"),
    [("8", 8, False), ("", 0, False), ("0", 0, False), ("many", 0, True)],
)
def test_the_environment_sets_the_engines_timed(value, count, said):
    code = "from hpcdl.nn import kernels; print(kernels.autotune())"
    env = {"HPCDL_CUDNN_AUTOTUNE": value, "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(count)
    assert ("HPCDL_CUDNN_AUTOTUNE='many' is no count" in out.stderr) is said


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a GPU")
def test_autotuned_convolutions_time_real_engines_and_give_the_reference_on_the_gpu(monkeypatch):
    """Real cuDNN: a 3x3 convolution's first 4 engines built, timed at the first run and the
    fastest kept, through the frontend's build / workspace / execute by index; the result is
    the NumPy reference's."""
    cp = cupy_or_none()
    if cudnn_graphs.runtime() is None:
        pytest.skip("nvidia-cudnn-frontend is not installed")
    monkeypatch.setattr(kernels, "_autotune", 4)
    ref = nn.Conv2d(16, 32, 3, padding=1)
    nn.Model("c", [ref], (16, 12, 12), 10, seed=4)
    fast = nn.Conv2d(16, 32, 3, padding=1)
    nn.Model("c", [fast], (16, 12, 12), 10, seed=4, xp=cp)
    ref.input_grad = fast.input_grad = True
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 12, 12, 16)).astype(np.float32)
    dy = rng.standard_normal((8, 12, 12, 32)).astype(np.float32)
    monkeypatch.setattr(kernels, "_enabled", True)
    y = fast.forward(cp.asarray(x))
    dx = fast.backward(cp.asarray(dy))
    assert isinstance(fast.seam.kernel, conv_kernels.CudnnConv)
    monkeypatch.setattr(kernels, "_enabled", False)
    conv = conv_kernels.KERNELS[0]
    tuned = [
        conv.cache._plans[cudnn_graphs._as_built(k)] for k in conv.keys(fast, x.shape).values()
    ]
    seen = [(p.name, p.timed_ms) for p in tuned]
    assert all(p.name and not p.untimed for p in tuned), seen  # named, and none left to time
    assert all(p.index in p.timed_ms for p in tuned if p.timed_ms), seen  # the fastest runs
    assert max(len(p.timed_ms) for p in tuned) > 1, seen  # a 3x3 has more than one engine
    np.testing.assert_allclose(cp.asnumpy(y), ref.forward(x), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(cp.asnumpy(dx), ref.backward(dy), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(cp.asnumpy(fast.g["W"]), ref.g["W"], rtol=1e-3, atol=1e-3)
