"""hpcdl.nn.kernels' cuDNN graphs (--gpu-kernels): plan cache, NHWC/KRSC layouts, dtypes, the
fallback and the seam's choice, on CPU with a stand-in cudnn module that runs the graphs in
NumPy (tests/fake_cudnn.py); against the NumPy reference on a GPU where one exists."""

import subprocess
import sys

import fake_cudnn
import numpy as np
import pytest
from fake_cudnn import Module, install

from hpcdl import nn
from hpcdl.backend import cupy_or_none, gpu_available
from hpcdl.nn import kernels
from hpcdl.nn.kernels import batchnorm as bn_kernels
from hpcdl.nn.kernels import conv as conv_kernels
from hpcdl.nn.kernels import cudnn_graphs

STREAM = 0x5EED  # the stand-in runtime's "current stream"


@pytest.fixture
def fake(monkeypatch):
    """The stand-in module as the process's cuDNN, on NumPy arrays, kernels on."""
    return install(monkeypatch, Module(), stream=STREAM, batch_norm=False, enable=True)


def conv_pair(monkeypatch, c_in, c_out, k, stride, pad, bias=True, precision="fp32"):
    """(cuDNN layer, reference layer) with the same weights, in models of their own."""
    layers = []
    for _ in range(2):
        conv = nn.Conv2d(c_in, c_out, k, stride=stride, padding=pad, bias=bias)
        model = nn.Model("c", [conv], (c_in, 9, 9), 10, seed=4)
        if precision != "fp32":
            model.set_precision(precision)
            model._compute_params[...] = model.params
        layers.append(conv)
    return layers


def run(layer, x, dy_seed=1, input_grad=True):
    """Forward, then backward of a random dy (rounded to the layer's format, as Sequential
    hands it over); returns (y, dx, gradients)."""
    layer.input_grad = input_grad
    y = layer.forward(x)
    dy = np.random.default_rng(dy_seed).standard_normal(y.shape).astype(np.float32)
    if layer.precision != "fp32":
        nn.precision.round_in_place(dy.reshape(-1), layer.precision)
    dx = layer.backward(dy)
    grads = {name: g.copy() for name, g in layer.g.items()}
    return y, dx, grads


def reference(layer, x, input_grad=True):
    enabled = kernels.enabled()
    kernels.enable(False)
    try:
        return run(layer, x, input_grad=input_grad)
    finally:
        kernels.enable(enabled)


CASES = [
    (3, 4, 3, 1, 1, True),
    (4, 6, 3, 2, 1, False),
    (5, 3, 1, 1, 0, True),
    (2, 3, 2, 2, 0, True),
]


@pytest.mark.parametrize(("c_in", "c_out", "k", "stride", "pad", "bias"), CASES)
@pytest.mark.parametrize("input_grad", [True, False])
def test_cudnn_conv_gives_the_reference_forward_and_gradients(
    fake, monkeypatch, c_in, c_out, k, stride, pad, bias, input_grad
):
    fast, ref = conv_pair(monkeypatch, c_in, c_out, k, stride, pad, bias)
    x = np.random.default_rng(0).standard_normal((3, 9, 9, c_in)).astype(np.float32)
    y, dx, grads = run(fast, x, input_grad=input_grad)
    assert isinstance(fast.seam.kernel, conv_kernels.CudnnConv)
    y_ref, dx_ref, grads_ref = reference(ref, x, input_grad)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    for name in grads_ref:
        np.testing.assert_allclose(grads[name], grads_ref[name], rtol=1e-4, atol=1e-4)
    if input_grad:
        np.testing.assert_allclose(dx, dx_ref, rtol=1e-5, atol=1e-5)
    else:
        assert dx is None and dx_ref is None
    assert y.dtype == np.float32


def test_plans_are_built_once_per_shape_in_the_frontends_order(fake, monkeypatch):
    fast, _ = conv_pair(monkeypatch, 3, 4, 3, 1, 1)
    x = np.ones((2, 9, 9, 3), np.float32)
    for _ in range(3):
        run(fast, x)
    assert len(fake.graphs) == 3 and fake.executions == 9  # fprop, wgrad, dgrad; 3 steps
    assert fake.graphs[0].built == [
        "validate",
        "operation_graph",
        ("plans", ("A", "FALLBACK"), ("deselect", ("TENSOR_CORE", "DOWN_CONVERT_INPUTS"))),
        "support",
        "build",
    ]
    run(fast, np.ones((5, 9, 9, 3), np.float32))  # another batch: another shape
    assert len(fake.graphs) == 6
    assert conv_kernels.KERNELS[0].cache.builds == 6


def deselected(graph):
    """The numeric notes a built graph's plans left out (fake_cudnn records them)."""
    plans = next(step for step in graph.built if isinstance(step, tuple))
    return [names for kind, names in plans[2:] if kind == "deselect"]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_float32_graphs_leave_out_tf32_engines_unless_tf32_is_allowed(fake, monkeypatch, precision):
    """NOTE [TF32]: a float32 convolution runs IEEE float32 engines only (cuDNN would pick
    TF32 tensor cores), with --tf32 any engine, in plans of their own; a half format's graphs
    keep tensor cores, and --tf32 changes none of its plans."""
    fp32 = precision == "fp32"
    fast, _ = conv_pair(monkeypatch, 3, 4, 3, 1, 1, precision=precision)
    run(fast, np.ones((2, 9, 9, 3), np.float32))
    strict = [("TENSOR_CORE", "DOWN_CONVERT_INPUTS")] if fp32 else []
    assert [deselected(g) for g in fake.graphs] == [strict] * 3  # fprop, wgrad, dgrad
    monkeypatch.setattr(kernels, "_tf32", True)
    run(fast, np.ones((2, 9, 9, 3), np.float32))
    assert [deselected(g) for g in fake.graphs[3:]] == ([[]] * 3 if fp32 else [])


@pytest.mark.parametrize(("precision", "tf32"), [("fp32", False), ("fp32", True), ("bf16", False)])
def test_deterministic_graphs_leave_out_nondeterministic_engines(
    fake, monkeypatch, precision, tf32
):
    """HPCDL_DETERMINISTIC (NOTE [deterministic engines]). Off, the plans keep cuDNN's
    nondeterministic engines (its default); on, every graph of every format leaves them out,
    beside what NOTE [TF32] leaves out, in plans built anew."""
    monkeypatch.setattr(kernels, "_tf32", tf32)
    fast, _ = conv_pair(monkeypatch, 3, 4, 3, 1, 1, precision=precision)
    x = np.ones((2, 9, 9, 3), np.float32)
    y_default = run(fast, x)[0]
    strict = [("TENSOR_CORE", "DOWN_CONVERT_INPUTS")] if precision == "fp32" and not tf32 else []
    assert [deselected(g) for g in fake.graphs] == [strict] * 3  # fprop, wgrad, dgrad
    monkeypatch.setattr(kernels, "_deterministic", True)
    y = run(fast, x)[0]
    notes = (*strict[0], "NONDETERMINISTIC") if strict else ("NONDETERMINISTIC",)
    assert [deselected(g) for g in fake.graphs[3:]] == [[notes]] * 3
    np.testing.assert_array_equal(y, y_default)  # the stand-in's arithmetic is one engine's
    run(fast, x)
    assert len(fake.graphs) == 6  # built once per setting


@pytest.mark.parametrize(("value", "on"), [("1", True), ("0", False), ("", False)])
def test_the_environment_turns_deterministic_engines_on(value, on):
    code = "from hpcdl.nn import kernels; print(kernels.deterministic())"
    env = {"HPCDL_DETERMINISTIC": value, "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(on)


def test_the_setting_is_read_and_changed_in_one_place(monkeypatch):
    monkeypatch.setattr(kernels, "_deterministic", False)
    kernels.make_deterministic(True)
    assert kernels.deterministic() is True
    kernels.make_deterministic(False)
    assert kernels.deterministic() is False


def test_layouts_are_nhwc_activations_and_krsc_filters_named_in_nchw_order(fake, monkeypatch):
    fast, _ = conv_pair(monkeypatch, 3, 4, 3, 2, 1)
    run(fast, np.ones((2, 9, 9, 3), np.float32))
    fprop = next(g for g in fake.graphs if g.ops[0][0].op == "conv_fprop").ops[0][0]
    x, w = fprop.inputs["x"], fprop.inputs["w"]
    assert (x.dim, x.stride) == ([2, 3, 9, 9], [9 * 9 * 3, 1, 9 * 3, 3])
    assert (w.dim, w.stride) == ([4, 3, 3, 3], [3 * 3 * 3, 1, 3 * 3, 3])  # K, C, R, S over KRSC
    assert (fprop.dim, fprop.stride) == ([2, 4, 5, 5], [5 * 5 * 4, 1, 5 * 4, 4])
    # the stored weight keeps hpcdl's layout; the KRSC copy is a workspace
    assert fast.p["W"].shape == (3, 3, 3, 4) and fast._workspace("cudnn_w_krsc").shape == (
        4,
        3,
        3,
        3,
    )


def test_a_shape_cudnn_refuses_falls_back_to_the_reference_and_says_so_once(
    fake, monkeypatch, capsys
):
    fake.refuse = lambda op, dims, dtype: op == "conv_wgrad" and dims[0] == 7
    fast, ref = conv_pair(monkeypatch, 3, 4, 3, 1, 1)
    x = np.random.default_rng(2).standard_normal((7, 9, 9, 3)).astype(np.float32)
    for _ in range(2):
        y, dx, grads = run(fast, x)
    assert fast.seam.kernel is None  # the reference ran: bitwise its numbers
    y_ref, dx_ref, grads_ref = reference(ref, x)
    np.testing.assert_array_equal(y, y_ref)
    np.testing.assert_array_equal(dx, dx_ref)
    err = capsys.readouterr().err
    assert err.count("cuDNN has no plan for conv_wgrad") == 1, err
    assert "runs hpcdl's own kernels" in err
    run(fast, np.ones((2, 9, 9, 3), np.float32))  # another shape still takes cuDNN
    assert isinstance(fast.seam.kernel, conv_kernels.CudnnConv)


def test_a_missing_half_plan_runs_that_op_alone_in_float32_said_once_in_one_line(
    fake, monkeypatch, capsys
):
    """The H100 run's second fault: no bf16 plan for the 7x7 stem's weight gradient with 3 input
    channels. That op alone runs a float32 plan; the forward stays bf16 in cuDNN, one line."""
    fake.refuse = lambda op, dims, dtype: (
        op == "conv_wgrad" and dtype == "BFLOAT16" and dims[1] == 3
    )
    fast, ref = conv_pair(monkeypatch, 3, 4, 7, 2, 3, bias=False, precision="bf16")
    x = np.random.default_rng(6).standard_normal((2, 9, 9, 3)).astype(np.float32)
    nn.precision.round_in_place(x, "bf16")
    for _ in range(2):
        y, _, grads = run(fast, x, input_grad=False)
    assert isinstance(fast.seam.kernel, conv_kernels.CudnnConv)  # the layer stayed on cuDNN
    types = {(g.ops[0][0].op, g.ops[0][0].inputs[next(iter(g.ops[0][0].inputs))].data_type)
             for g in fake.graphs if "build" in g.built}  # fmt: skip
    assert types == {("conv_fprop", "BFLOAT16"), ("conv_wgrad", "FLOAT")}
    y_ref, _, grads_ref = reference(ref, x, input_grad=False)
    np.testing.assert_allclose(y, y_ref, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(grads["W"], grads_ref["W"], rtol=1e-4, atol=1e-4)  # float32 sums
    lines = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(lines) == 1, lines
    assert "conv_wgrad" in lines[0] and "bfloat16" in lines[0]
    assert lines[0].endswith("that op runs in float32"), lines[0]


@pytest.mark.parametrize("op", ["conv_fprop", "conv_dgrad", "conv_wgrad"])
def test_any_refused_half_convolution_op_runs_alone_in_float32(fake, monkeypatch, capsys, op):
    fake.refuse = lambda o, dims, dtype: o == op and dtype == "BFLOAT16"
    fast, ref = conv_pair(monkeypatch, 3, 4, 3, 1, 1, precision="bf16")
    x = np.random.default_rng(8).standard_normal((2, 9, 9, 3)).astype(np.float32)
    nn.precision.round_in_place(x, "bf16")
    y, dx, grads = run(fast, x)
    assert isinstance(fast.seam.kernel, conv_kernels.CudnnConv)
    built = {g.ops[0][0].op: g.options["io_data_type"] for g in fake.graphs if "build" in g.built}
    assert built == {o: "FLOAT" if o == op else "BFLOAT16"
                     for o in ("conv_fprop", "conv_dgrad", "conv_wgrad")}  # fmt: skip
    y_ref, dx_ref, grads_ref = reference(ref, x)
    for got, want in ((y, y_ref), (dx, dx_ref), (grads["W"], grads_ref["W"])):
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
    assert capsys.readouterr().err.count("that op runs in float32") == 1


def test_a_missing_half_batchnorm_plan_runs_in_float32(fake_bn, capsys):
    fake_bn.refuse = lambda op, dims, dtype: op == "batchnorm_backward" and dtype == "BFLOAT16"
    fast, ref = bn_pair(precision="bf16")
    x = np.random.default_rng(7).standard_normal((4, 6, 6, 5)).astype(np.float32)
    nn.precision.round_in_place(x, "bf16")
    y, dx, grads = run(fast, x)
    assert isinstance(fast.seam.kernel, bn_kernels.CudnnBatchNorm)
    y_ref, dx_ref, grads_ref = reference(ref, x)
    np.testing.assert_allclose(dx, dx_ref, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(grads["gamma"], grads_ref["gamma"], rtol=2e-2, atol=2e-2)
    assert capsys.readouterr().err.count("that op runs in float32") == 1


@pytest.mark.parametrize(("precision", "name"), [("bf16", "BFLOAT16"), ("fp16", "HALF")])
def test_half_precision_runs_the_formats_arrays_and_sums_weight_gradients_in_float32(
    fake, monkeypatch, precision, name
):
    fast, ref = conv_pair(monkeypatch, 3, 4, 3, 1, 1, precision=precision)
    x = np.random.default_rng(3).standard_normal((2, 9, 9, 3)).astype(np.float32)
    nn.precision.round_in_place(x, precision)  # what a layer receives under --precision
    y, dx, grads = run(fast, x)
    graph = fake.graphs[0]
    assert graph.options["io_data_type"] == name
    assert graph.options["compute_data_type"] == "FLOAT"
    wgrad = next(g for g in fake.graphs if g.ops[0][0].op == "conv_wgrad").ops[0][0]
    assert wgrad.data_type == "FLOAT" and wgrad.inputs["x"].data_type == name
    assert fast._buffers.held("cudnn_x").dtype == nn.dtypes.half_dtype(precision)
    y_ref, _, grads_ref = reference(ref, x)
    tol = 2e-2 if precision == "bf16" else 2e-3  # the output's rounding to the format
    np.testing.assert_allclose(y, y_ref, rtol=tol, atol=tol)
    np.testing.assert_allclose(grads["W"], grads_ref["W"], rtol=tol, atol=tol)


@pytest.mark.parametrize(("precision", "name"), [("bf16", "BFLOAT16"), ("fp16", "HALF")])
def test_half_weight_gradients_come_out_in_the_format_and_widen_into_float32(
    fake, monkeypatch, precision, name
):
    """HPCDL_HALF_WGRAD (NOTE [half weight gradients]): the weight gradient's graph writes the
    format, as PyTorch's autocast computes it, and the transpose into the float32 gradient
    buffer widens it: the reference's gradient rounded to the format once. In plans of their
    own; float32 keeps its float32 weight gradient."""
    fast, ref = conv_pair(monkeypatch, 3, 4, 3, 1, 1, precision=precision)
    x = np.random.default_rng(3).standard_normal((2, 9, 9, 3)).astype(np.float32)
    nn.precision.round_in_place(x, precision)
    grads_float = run(fast, x)[2]["W"]
    monkeypatch.setattr(kernels, "_half_wgrad", True)
    y, _, grads = run(fast, x)
    wgrads = [g.ops[0][0] for g in fake.graphs if g.ops[0][0].op == "conv_wgrad"]
    assert [w.data_type for w in wgrads] == ["FLOAT", name]  # a plan of its own
    assert grads["W"].dtype == np.float32
    rounded = grads_float.copy()
    nn.precision.round_in_place(rounded, precision)
    np.testing.assert_array_equal(grads["W"], rounded)
    _, _, grads_ref = reference(ref, x)
    tol = 2e-2 if precision == "bf16" else 2e-3
    np.testing.assert_allclose(grads["W"], grads_ref["W"], rtol=tol, atol=tol)


def test_half_weight_gradients_leave_float32_alone(fake, monkeypatch):
    fast, _ = conv_pair(monkeypatch, 3, 4, 3, 1, 1)
    monkeypatch.setattr(kernels, "_half_wgrad", True)
    run(fast, np.ones((2, 9, 9, 3), np.float32))
    (wgrad,) = [g.ops[0][0] for g in fake.graphs if g.ops[0][0].op == "conv_wgrad"]
    assert wgrad.data_type == "FLOAT"


def test_a_convolution_holds_its_input_for_the_weight_gradient_without_a_copy(fake, monkeypatch):
    """A float32 input is read where it is (a pass per convolution and step saved); an
    emulated one (float32 holding the format's values) is copied into the format, as before."""
    fast, _ = conv_pair(monkeypatch, 3, 4, 3, 1, 1)
    x = np.random.default_rng(3).standard_normal((2, 9, 9, 3)).astype(np.float32)
    fast.forward(x)
    assert fast._buffers.held("cudnn_x") is x
    fast.backward(np.ones((2, 9, 9, 4), np.float32))
    assert fast._buffers.last("cudnn_x") is None and fast._buffers.last("cudnn_dy") is None


def test_without_the_frontend_the_kernel_never_applies(monkeypatch):
    monkeypatch.setattr(cudnn_graphs, "_RUNTIME", None)
    monkeypatch.setattr(cudnn_graphs, "_LOADED", True)
    monkeypatch.setattr(kernels, "_enabled", True)
    layer = nn.Conv2d(2, 2, 3)
    nn.Model("c", [layer], (2, 5, 5), 10)
    assert not conv_kernels.CudnnConv().applies(layer, np.ones((1, 5, 5, 2), np.float32))


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a GPU")
@pytest.mark.parametrize(("c_in", "c_out", "k", "stride", "pad", "bias"), CASES)
def test_cudnn_conv_on_the_gpu_matches_the_numpy_reference(c_in, c_out, k, stride, pad, bias):
    cp = cupy_or_none()
    if cudnn_graphs.runtime() is None:
        pytest.skip("nvidia-cudnn-frontend is not installed")
    ref = nn.Conv2d(c_in, c_out, k, stride=stride, padding=pad, bias=bias)
    nn.Model("c", [ref], (c_in, 9, 9), 10, seed=4)
    fast = nn.Conv2d(c_in, c_out, k, stride=stride, padding=pad, bias=bias)
    nn.Model("c", [fast], (c_in, 9, 9), 10, seed=4, xp=cp)
    ref.input_grad = fast.input_grad = True  # a model's first layer computes no dx: this one does
    x = np.random.default_rng(0).standard_normal((3, 9, 9, c_in)).astype(np.float32)
    kernels.enable(True)
    try:
        y = fast.forward(cp.asarray(x))
        dy = np.random.default_rng(1).standard_normal(y.shape).astype(np.float32)
        dx = fast.backward(cp.asarray(dy))
        assert isinstance(fast.seam.kernel, conv_kernels.CudnnConv)
    finally:
        kernels.enable(False)
    y_ref = ref.forward(x)
    dx_ref = ref.backward(dy)
    np.testing.assert_allclose(cp.asnumpy(y), y_ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(cp.asnumpy(dx), dx_ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(cp.asnumpy(fast.g["W"]), ref.g["W"], rtol=1e-3, atol=1e-3)


@pytest.fixture
def fake_bn(fake, monkeypatch):
    monkeypatch.setattr(bn_kernels, "KERNELS", [bn_kernels.CudnnBatchNorm()])
    return fake


def bn_pair(channels=5, precision="fp32", **options):
    layers = []
    for _ in range(2):
        bn = nn.BatchNorm(channels, **options)
        model = nn.Model("b", [bn], (channels, 6, 6), 10, seed=2)
        model._compute_params[...] = np.random.default_rng(9).uniform(0.5, 1.5, model.params.size)
        if precision != "fp32":
            model.set_precision(precision)
        layers.append(bn)
    return layers


@pytest.mark.parametrize("input_grad", [True, False])
def test_cudnn_batchnorm_gives_the_reference_statistics_output_and_gradients(fake_bn, input_grad):
    fast, ref = bn_pair()
    x = (np.random.default_rng(4).standard_normal((4, 6, 6, 5)) * 3 + 1).astype(np.float32)
    for _ in range(2):  # the running statistics move twice, the same way
        y, dx, grads = run(fast, x, input_grad=input_grad)
        y_ref, dx_ref, grads_ref = reference(ref, x, input_grad)
    assert isinstance(fast.seam.kernel, bn_kernels.CudnnBatchNorm)
    np.testing.assert_allclose(y, y_ref, rtol=1e-4, atol=1e-5)
    for name in ("gamma", "beta"):
        np.testing.assert_allclose(grads[name], grads_ref[name], rtol=1e-4, atol=1e-4)
    for name in ("running_mean", "running_var"):
        np.testing.assert_allclose(fast.b[name], ref.b[name], rtol=1e-5, atol=1e-6)
    if input_grad:
        np.testing.assert_allclose(dx, dx_ref, rtol=1e-4, atol=1e-5)
    else:
        assert dx is None
    evaluated = fast.forward(x, train=False), ref.forward(x, train=False)
    np.testing.assert_allclose(*evaluated, rtol=1e-5, atol=1e-6)


def test_sync_batchnorm_keeps_the_reference(fake_bn):
    fast, _ = bn_pair()
    fast.stat_reducer = lambda buf: None
    fast.count = np.array([4 * 6 * 6.0], np.float32)
    fast.forward(np.ones((4, 6, 6, 5), np.float32))
    assert fast.seam.kernel is None and fake_bn.graphs == []


def test_batchnorm_plans_declare_float32_statistics_and_pass_epsilon_by_value(fake_bn):
    fast, _ = bn_pair(precision="bf16")
    run(fast, np.ones((2, 6, 6, 5), np.float32))
    train = next(g for g in fake_bn.graphs if g.ops[0][0].op == "batchnorm")
    y, mean, inv_var, out_mean, out_var = train.ops[0]
    assert train.options["io_data_type"] == "BFLOAT16" and y.data_type == "BFLOAT16"
    assert {t.data_type for t in (mean, inv_var, out_mean, out_var)} == {"FLOAT"}
    assert (y.dim, y.stride) == ([2, 5, 6, 6], [6 * 6 * 5, 1, 6 * 5, 5])
    assert train.ops[0][0].inputs["scale"].dim == [1, 5, 1, 1]


def test_batchnorm_hands_epsilon_and_momentum_to_cudnn_as_host_scalars(fake_bn):
    """The H100 run's fault: epsilon and momentum went into the variant pack as NumPy arrays,
    which the frontend hands to DLPack with a stream. They are pass-by-value tensors: their
    values are host addresses, read at execute (the stand-in reads them there too)."""
    fast, ref = bn_pair(eps=1e-2, momentum=0.3)
    x = (np.random.default_rng(5).standard_normal((4, 6, 6, 5)) * 2).astype(np.float32)
    y, _, _ = run(fast, x)
    y_ref, _, _ = reference(ref, x)
    assert isinstance(fast.seam.kernel, bn_kernels.CudnnBatchNorm)
    train = next(g for g in fake_bn.graphs if g.ops[0][0].op == "batchnorm")
    inputs = train.ops[0][0].inputs
    assert inputs["eps"].is_pass_by_value and inputs["momentum"].is_pass_by_value
    np.testing.assert_allclose(y, y_ref, rtol=1e-4, atol=1e-5)  # epsilon 1e-2 was read
    np.testing.assert_allclose(fast.b["running_var"], ref.b["running_var"], rtol=1e-5)


def test_every_execute_runs_on_the_current_stream(fake_bn):
    """cuDNN's handle is set to CuPy's current stream before each execute, so its kernels join
    the step's stream and a CUDA graph capture on it (else they run on the legacy stream)."""
    fast, _ = bn_pair()
    run(fast, np.ones((2, 6, 6, 5), np.float32))
    assert fake_bn.executions == 2 and set(fake_bn.streams) == {STREAM}


# --- the stand-in refuses what the real frontend refuses (tests/fake_cudnn.py) -------------


def conv_graph(module, x_type="FLOAT", w_type="FLOAT", w_dim=(4, 3, 3, 3)):
    """A built conv_fprop graph over (2, 3, 5, 5) NHWC: (graph, x, w, y)."""
    dt = module.data_type
    g = module.pygraph(io_data_type=dt.FLOAT, intermediate_data_type=dt.FLOAT,
                       compute_data_type=dt.FLOAT, handle=module.create_handle())  # fmt: skip
    x = g.tensor(name="x", dim=[2, 3, 5, 5], stride=[75, 1, 15, 3], data_type=dt[x_type])
    k, c, r, s = w_dim
    w = g.tensor(name="w", dim=list(w_dim), stride=[r * s * c, 1, s * c, c], data_type=dt[w_type])
    y = g.conv_fprop(image=x, weight=w, padding=[1, 1], stride=[1, 1], dilation=[1, 1])
    y.set_output(True).set_dim([2, 4, 5, 5]).set_stride([100, 1, 20, 4]).set_data_type(dt.FLOAT)
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([module.heur_mode.A])
    g.check_support()
    g.build_plans()
    return g, x, w, y


def conv_pack(module, tx, tw, ty, **arrays):
    """The variant pack of conv_graph with device arrays (NumPy on the stand-in's device)."""
    a = {"x": np.ones((2, 5, 5, 3), np.float32), "w": np.ones((4, 3, 3, 3), np.float32),
         "y": np.zeros((2, 5, 5, 4), np.float32), **arrays}  # fmt: skip
    return {t: module.pointer(a[n]) if isinstance(a[n], np.ndarray) else a[n]
            for t, n in ((tx, "x"), (tw, "w"), (ty, "y")) if a[n] is not None}  # fmt: skip


def execute(module, graph, pack):
    workspace = module.pointer(np.zeros(64, np.uint8))
    graph.execute(pack, workspace, handle=module.create_handle())


def test_the_stand_in_runs_a_well_formed_graph():
    module = Module()
    g, x, w, y = conv_graph(module)
    out = np.zeros((2, 5, 5, 4), np.float32)
    execute(module, g, conv_pack(module, x, w, y, y=out))
    assert out[0, 2, 2, 0] == 27 and out[0, 0, 0, 0] == 12  # 3x3x3 ones, a corner 2x2x3


def test_the_stand_in_refuses_enums_that_are_not_its_own():
    module = Module()
    with pytest.raises(TypeError, match="io_data_type"):
        dt = module.data_type
        module.pygraph(io_data_type="FLOAT", intermediate_data_type=dt.FLOAT,
                       compute_data_type=dt.FLOAT, handle=module.create_handle())  # fmt: skip
    g, *_ = conv_graph(module)
    with pytest.raises(TypeError, match="data_type"):
        g.tensor(name="t", dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=np.float32)


def test_the_stand_in_refuses_dims_and_strides_that_are_not_lists_of_ints():
    module = Module()
    g, *_ = conv_graph(module)
    with pytest.raises(TypeError, match="ints"):
        g.tensor(
            name="t", dim=[2.0, 3, 1, 1], stride=[3, 1, 1, 1], data_type=module.data_type.FLOAT
        )
    with pytest.raises(TypeError, match="stride"):
        g.tensor(name="t", dim=[2, 3, 1, 1], stride=[3, 1, 1], data_type=module.data_type.FLOAT)


def test_the_stand_in_refuses_numpy_arrays_in_the_variant_pack_as_the_frontend_does():
    module = Module()
    g, x, w, y = conv_graph(module)
    pack = conv_pack(module, x, w, y, w=np.ones((4, 3, 3, 3), np.float32))
    pack[w] = np.ones((4, 3, 3, 3), np.float32)  # the array itself, not its address
    with pytest.raises(ValueError, match="NumPy only supports stream=None"):
        execute(module, g, pack)
    pack[w] = 3.5
    with pytest.raises(TypeError, match="address"):
        execute(module, g, pack)


def test_the_stand_in_refuses_a_variant_pack_missing_a_tensor():
    module = Module()
    g, x, w, y = conv_graph(module)
    with pytest.raises(ValueError, match="missing a buffer for tensor 'w'"):
        execute(module, g, conv_pack(module, x, w, y, w=None))


def test_the_stand_in_refuses_layouts_beyond_the_memory_and_other_dtypes():
    module = Module()
    g, x, w, y = conv_graph(module)
    with pytest.raises(ValueError, match="reach"):  # declared 2x5x5x3, given one image
        execute(module, g, conv_pack(module, x, w, y, x=np.ones((1, 5, 5, 3), np.float32)))
    with pytest.raises(TypeError, match="declared"):
        execute(module, g, conv_pack(module, x, w, y, x=np.ones((2, 5, 5, 3), np.float64)))
    with pytest.raises(ValueError, match="no device pointer"):
        execute(module, g, {**conv_pack(module, x, w, y), x: 12345})


def test_the_stand_in_refuses_convolution_operands_of_two_dtypes():
    with pytest.raises(fake_cudnn.cudnnGraphNotSupportedError, match="operands"):
        conv_graph(Module(), x_type="BFLOAT16", w_type="FLOAT")


def test_the_stand_in_refuses_scalars_not_passed_by_value():
    module = Module()
    dt = module.data_type
    g, *_ = conv_graph(module)
    with pytest.raises(ValueError, match="scalar"):
        g.tensor(name="eps", dim=[1, 2, 1, 1], stride=[2, 1, 1, 1], data_type=dt.FLOAT,
                 is_pass_by_value=True)  # fmt: skip
    g = module.pygraph(io_data_type=dt.FLOAT, intermediate_data_type=dt.FLOAT,
                       compute_data_type=dt.FLOAT, handle=module.create_handle())  # fmt: skip
    vec = lambda n: g.tensor(name=n, dim=[1, 3, 1, 1], stride=[3, 1, 3, 3], data_type=dt.FLOAT)  # noqa: E731
    x = g.tensor(name="x", dim=[2, 3, 4, 4], stride=[48, 1, 12, 3], data_type=dt.FLOAT)
    one = g.tensor(name="one", dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=dt.FLOAT)
    with pytest.raises(TypeError, match="epsilon: a pass-by-value tensor"):
        g.batchnorm(name="bn", input=x, scale=vec("s"), bias=vec("b"), in_running_mean=vec("m"),
                    in_running_var=vec("v"), epsilon=one, momentum=one)  # fmt: skip


def test_the_stand_in_refuses_a_device_pointer_for_a_pass_by_value_scalar():
    module = Module()
    host = np.full((1, 1, 1, 1), 0.25, np.float32)
    device = np.full((1, 1, 1, 1), 0.25, np.float32)
    module.pointer(device)
    g, *_ = conv_graph(module)
    t = g.tensor(name="eps", dim=[1, 1, 1, 1], stride=[1, 1, 1, 1],
                 data_type=module.data_type.FLOAT, is_pass_by_value=True)  # fmt: skip
    assert fake_cudnn._Host(int(host.ctypes.data), t, module).value == 0.25
    with pytest.raises(ValueError, match="host address"):
        fake_cudnn._Host(int(device.ctypes.data), t, module)


def test_the_stand_in_refuses_steps_out_of_order_and_a_small_workspace():
    module = Module()
    dt = module.data_type
    g = module.pygraph(io_data_type=dt.FLOAT, intermediate_data_type=dt.FLOAT,
                       compute_data_type=dt.FLOAT, handle=module.create_handle())  # fmt: skip
    with pytest.raises(RuntimeError, match="out of order"):
        g.build_plans()
    with pytest.raises(RuntimeError, match="before build_plans"):
        g.execute({}, 0, handle=module.create_handle())
    g, x, w, y = conv_graph(module)
    with pytest.raises(ValueError, match="workspace"):
        g.execute(conv_pack(module, x, w, y), module.pointer(np.zeros(8, np.uint8)),
                  handle=module.create_handle())  # fmt: skip
    with pytest.raises(TypeError, match="handle"):
        g.execute(conv_pack(module, x, w, y), module.pointer(np.zeros(64, np.uint8)), handle=7)


def test_the_stand_in_refuses_a_note_filter_out_of_order_or_of_foreign_notes():
    module = Module()
    note = module.numerical_note
    g, *_ = conv_graph(module)  # built: after check_support
    with pytest.raises(RuntimeError, match="out of order"):
        g.deselect_numeric_notes([note.TENSOR_CORE])
    dt = module.data_type
    g = module.pygraph(io_data_type=dt.FLOAT, intermediate_data_type=dt.FLOAT,
                       compute_data_type=dt.FLOAT, handle=module.create_handle())  # fmt: skip
    with pytest.raises(RuntimeError, match="out of order"):
        g.deselect_numeric_notes([note.TENSOR_CORE])  # before create_execution_plans
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([module.heur_mode.A])
    with pytest.raises(TypeError, match="numerical_note"):
        g.deselect_numeric_notes(["TENSOR_CORE"])
    g.deselect_numeric_notes([note.TENSOR_CORE])
    assert g.built[-1] == ("plans", ("A",), ("deselect", ("TENSOR_CORE",)))


def test_the_runtime_refuses_a_host_array_for_a_device_tensor():
    """The real runtime's pointers: a NumPy array is no device memory (one clear TypeError,
    not the frontend's DLPack error deep in execute)."""
    with pytest.raises(TypeError, match="device memory"):
        cudnn_graphs.device_pointer(np.ones(3, np.float32))
    with pytest.raises(TypeError, match="one NumPy element"):
        cudnn_graphs.host_address(np.ones(3, np.float32))
    assert cudnn_graphs.host_address(np.ones(1, np.float32)) > 0


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a GPU")
@pytest.mark.parametrize("model_name", ["cnn", "resnet20"])
def test_a_model_with_gpu_kernels_matches_the_numpy_reference(model_name):
    """Logits and every gradient of one training step, cuDNN graphs against NumPy (float32).
    The NumPy side runs with the kernels on too: there only Philox dropout applies (the H200
    run of 2026-11-29 compared cnn's Philox masks with the reference dropout's, other masks)."""
    cp = cupy_or_none()
    if cudnn_graphs.runtime() is None:
        pytest.skip("nvidia-cudnn-frontend is not installed")
    shape = (3, 32, 32)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, *shape)).astype(np.float32)
    y = rng.integers(0, 10, 8)
    ref = nn.build_model(model_name, shape, 10, seed=1)
    fast = nn.build_model(model_name, shape, 10, seed=1, xp=cp)
    for model in (ref, fast):
        model.set_rng_state(nn.rank_rng_state(1, 0))
    kernels.enable(True)
    try:
        logits_ref = ref.forward(x)
        ref.backward(nn.softmax_cross_entropy(logits_ref, y)[1])
        logits = fast.forward(cp.asarray(x))
        fast.backward(nn.softmax_cross_entropy(logits, cp.asarray(y))[1])
    finally:
        kernels.enable(False)
    np.testing.assert_allclose(cp.asnumpy(logits), logits_ref, rtol=1e-3, atol=1e-4)
    grads, off = cp.asnumpy(fast.grads), []
    for name, shape, at in ref.layout():  # each parameter beyond the tolerance, named
        a, b = (g[at : at + int(np.prod(shape))] for g in (grads, ref.grads))
        bad = ~np.isclose(a, b, rtol=1e-2, atol=1e-4)
        if bad.any():
            off.append(f"{name}: {bad.sum()} of {bad.size}, up to {np.abs(a - b).max():.2e} "
                       f"(largest |grad| {np.abs(b).max():.2e})")  # fmt: skip
    # the H200 run of 2026-11-29 found resnet20's float32 weight gradients off in one layer:
    # which engines cuDNN ran says whether it is theirs (Winograd, FFT) or the kernels'
    assert not off, (off, cudnn_graphs.plan_report(each=True))
