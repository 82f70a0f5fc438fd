"""BatchNorm + ReLU (+ the residual add) fused through cuDNN graphs (hpcdl.nn.kernels.batchnorm
CudnnBatchNormRelu), on CPU with the strict stand-in (tests/fake_cudnn.py): against the plain
reference forward and backward, and chosen for the BN -> ReLU and BN -> add -> ReLU patterns
of ResNet blocks with --gpu-kernels only."""

import numpy as np
import pytest
from fake_cudnn import Module, install

from hpcdl import nn
from hpcdl.backend import cupy_or_none, gpu_available
from hpcdl.nn import kernels
from hpcdl.nn.kernels import batchnorm as bn_kernels
from hpcdl.nn.kernels import cudnn_graphs

FUSED = bn_kernels.CudnnBatchNormRelu


@pytest.fixture
def fake(monkeypatch):
    return install(monkeypatch, Module(), stream=7, enable=True)


def bn_layer(precision="fp32", channels=5, xp=np):
    bn = nn.BatchNorm(channels)
    model = nn.Model("b", [bn], (channels, 6, 6), 10, seed=2, xp=xp)
    scales = np.random.default_rng(9).uniform(0.5, 1.5, model.params.size)
    model._compute_params[...] = xp.asarray(scales, dtype=model._compute_params.dtype)
    if precision != "fp32":
        model.set_precision(precision, real=True)
    bn.input_grad = True
    return bn


def reference(bn, x, residual, dz):
    """(z, dx, d residual, gamma and beta gradients, running stats): BatchNorm bn, then the add
    and the ReLU, in NumPy float32, kernels off."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernels, "_enabled", False)
        relu = nn.ReLU(inplace=True)
        y = bn.forward(x.astype(np.float32))
        res = None if residual is None else residual.astype(np.float32)
        z = relu.forward(y, residual=res)
        dpre = relu.backward(dz.astype(np.float32))
        dx = bn.backward(dpre)
        return z, dx, dpre, dict(bn.g), dict(bn.b)


@pytest.mark.parametrize("with_residual", [False, True], ids=["bn-relu", "bn-add-relu"])
@pytest.mark.parametrize(("precision", "tol"), [("fp32", 1e-4), ("bf16", 3e-2), ("fp16", 4e-3)])
def test_fused_kernel_gives_the_reference_forward_and_backward(fake, with_residual, precision, tol):
    rng = np.random.default_rng(4)
    half = nn.dtypes.half_dtype(precision)
    x = (rng.standard_normal((4, 6, 6, 5)) * 3 + 1).astype(half)
    residual = rng.standard_normal(x.shape).astype(half) if with_residual else None
    dz = rng.standard_normal(x.shape).astype(half)
    bn, bn_ref = bn_layer(precision), bn_layer()
    for _ in range(2):  # the running statistics move twice, the same way
        z = bn.forward_relu(x, True, residual=residual)
        assert isinstance(bn.seam.kernel, FUSED) and z.dtype == half
        dx = bn.backward(dz)
        ref = reference(bn_ref, x, residual, dz)
    z_ref, dx_ref, dpre_ref, grads_ref, stats_ref = ref
    f32 = np.float32
    np.testing.assert_allclose(z.astype(f32), z_ref, rtol=tol, atol=tol)
    np.testing.assert_allclose(dx.astype(f32), dx_ref, rtol=tol, atol=tol * 10)
    for name in ("gamma", "beta"):
        np.testing.assert_allclose(bn.g[name], grads_ref[name], rtol=tol, atol=tol * 10)
    for name in ("running_mean", "running_var"):
        np.testing.assert_allclose(bn.b[name], stats_ref[name], rtol=tol, atol=tol)
    if with_residual:
        assert bn.residual_grad.dtype == half
        np.testing.assert_allclose(bn.residual_grad.astype(f32), dpre_ref, rtol=tol, atol=tol)
    else:
        assert bn.residual_grad is None


def test_the_fused_graph_is_batchnorm_add_relu_with_float32_statistics(fake):
    """BnAddRelu (NOTE [fused BatchNorm backward]): the forward writes the ReLU's bitmask,
    which the backward's product reads; the product is typed and an output (the shortcut's)."""
    bn = bn_layer()
    x = np.random.default_rng(1).standard_normal((2, 6, 6, 5)).astype(np.float32)
    bn.forward_relu(x, True, residual=np.ones_like(x))
    bn.backward(np.ones_like(x))
    forward, backward = fake.graphs
    assert [outs[0].op for outs in forward.ops] == ["batchnorm", "add", "relu", "cmp_gt"]
    assert forward.ops[1][0].inputs["a"] is forward.ops[0][0]  # bn's y feeds the add, virtual
    assert not forward.ops[0][0].is_output
    mask = forward.ops[3][0]
    assert mask.is_output and mask.data_type is fake.data_type.BOOLEAN
    assert bn._work.last("cudnn_mask").nbytes >= -(-x.size // 8)  # eight elements to a byte
    assert [outs[0].op for outs in backward.ops] == ["scale", "batchnorm_backward"]
    product = backward.ops[0][0]
    assert product.is_output and product.data_type is fake.data_type.FLOAT
    assert backward.ops[0][0].inputs["scale"].data_type is fake.data_type.BOOLEAN


def test_the_fused_bn_relu_backward_recomputes_batchnorms_output(fake):
    """DReluForkDBn (NOTE [fused BatchNorm backward]): no tensor of the forward's output is
    kept; the ReLU's backward reads batchnorm_inference's result, typed in the I/O format."""
    bn = bn_layer("bf16")
    x = np.random.default_rng(1).standard_normal((2, 6, 6, 5)).astype(nn.dtypes.half_dtype("bf16"))
    bn.forward_relu(x, True)
    bn.backward(np.ones_like(x))
    forward, backward = fake.graphs
    assert [outs[0].op for outs in forward.ops] == ["batchnorm", "relu"]
    ops = [outs[0] for outs in backward.ops]
    assert [op.op for op in ops] == ["batchnorm_inference", "relu_backward", "batchnorm_backward"]
    assert ops[1].inputs["input"] is ops[0] and not ops[0].is_output
    assert ops[1].data_type is fake.data_type.BFLOAT16 and not ops[1].is_output
    assert bn._work.last("cudnn_z") is None and bn._work.last("cudnn_mask") is None


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a GPU")
@pytest.mark.parametrize("with_residual", [False, True], ids=["bn-relu", "bn-add-relu"])
@pytest.mark.parametrize(("precision", "tol"), [("fp32", 1e-3), ("bf16", 3e-2)])
def test_the_fused_kernel_runs_on_the_gpu_and_gives_the_reference(
    monkeypatch, with_residual, precision, tol
):
    """Real cuDNN takes the fused graphs of NOTE [fused BatchNorm backward] in bf16 (the H200
    of 2026-11-29 refused the earlier ones for every shape) and they give the reference's
    numbers; in float32 either kernel may run (the frontend's samples are half), and what ran
    must agree too. resnet50's channels: 64."""
    cp = cupy_or_none()
    if cudnn_graphs.runtime() is None:
        pytest.skip("nvidia-cudnn-frontend is not installed")
    monkeypatch.setattr(kernels, "_enabled", True)
    rng, half = np.random.default_rng(4), nn.dtypes.half_dtype(precision)
    x, residual, dz = (cp.asarray(rng.standard_normal((8, 6, 6, 64)).astype(half)) for _ in "xrd")
    residual = residual if with_residual else None
    bn, bn_ref = bn_layer(precision, 64, cp), bn_layer(channels=64, xp=cp)
    z = bn.forward_relu(x, True, residual=residual)
    if precision == "bf16":
        assert isinstance(bn.seam.kernel, FUSED), "cuDNN refused the fused BatchNorm graphs"
    dx = bn.backward(dz)
    z_ref, dx_ref, dpre_ref, grads_ref, _ = reference(bn_ref, x, residual, dz)
    f32 = np.float32
    np.testing.assert_allclose(cp.asnumpy(z.astype(f32)), cp.asnumpy(z_ref), rtol=tol, atol=tol)
    np.testing.assert_allclose(
        cp.asnumpy(dx.astype(f32)), cp.asnumpy(dx_ref), rtol=tol, atol=tol * 10
    )
    for name in ("gamma", "beta"):
        np.testing.assert_allclose(
            cp.asnumpy(bn.g[name]), cp.asnumpy(grads_ref[name]), rtol=tol, atol=tol * 10
        )
    if with_residual and isinstance(bn.seam.kernel, FUSED):
        np.testing.assert_allclose(
            cp.asnumpy(bn.residual_grad.astype(f32)), cp.asnumpy(dpre_ref), rtol=tol, atol=tol
        )


def watch_outputs(model):
    """The dtype of every array a leaf layer returns, forward and backward (None: no dx)."""
    seen = []

    def watched(method, name):
        def call(x, *args, **kwargs):
            y = method(x, *args, **kwargs)
            seen.append((name, x.dtype, None if y is None else y.dtype))
            return y

        return call

    for leaf in model.body.leaves():
        name = type(leaf).__name__
        leaf.forward, leaf.backward = watched(leaf.forward, name), watched(leaf.backward, name)
    return seen


def resnet(monkeypatch, on):
    monkeypatch.setattr(kernels, "_enabled", on)
    model = nn.build_model("resnet20", (3, 8, 8), 10, seed=1)
    x = np.random.default_rng(2).standard_normal((2, 3, 8, 8)).astype(np.float32)
    labels = np.array([1, 7])
    _, dlogits = nn.softmax_cross_entropy(model.forward(x), labels)
    model.backward(dlogits)
    return model


def block_norms(model):
    """(BN -> ReLU norms, BN -> add -> ReLU norms) of the model's blocks and stem."""
    blocks = [layer for layer in model.body.layers if isinstance(layer, nn.ResidualBlock)]
    relu_bns = [model.body.layers[1]] + [b.branch.layers[1] for b in blocks]
    return relu_bns, [b.branch.layers[-1] for b in blocks]


def test_resnet_blocks_use_the_fused_kernel_with_gpu_kernels_and_the_reference_without(
    fake, monkeypatch
):
    fused = resnet(monkeypatch, True)
    relu_bns, add_bns = block_norms(fused)
    assert isinstance(fused.body.layers[1], nn.BatchNorm)  # the stem: conv, BN, ReLU
    assert all(isinstance(bn.seam.kernel, FUSED) for bn in relu_bns + add_bns)
    plain = resnet(monkeypatch, False)
    assert all(bn.seam.kernel is None for bn in sum(block_norms(plain), []))
    np.testing.assert_allclose(fused.grads, plain.grads, rtol=1e-3, atol=1e-4)


def test_a_shape_cudnn_cannot_fuse_runs_the_unfused_kernels_said_once_per_shape(
    monkeypatch, capsys
):
    install(monkeypatch, Module(refuse=lambda op, dims, dtype: op == "relu"), stream=7, enable=True)
    fused = resnet(monkeypatch, True)
    relu_bns, add_bns = block_norms(fused)
    assert all(type(bn.seam.kernel) is bn_kernels.CudnnBatchNorm for bn in relu_bns + add_bns)
    said = [line for line in capsys.readouterr().err.splitlines() if "bn_relu_train" in line]
    assert len(said) == len(set(said)) == 3  # once per shape: 16, 32 and 64 channels
    assert all(line.endswith("BatchNorm and its ReLU run unfused") for line in said)
    resnet(monkeypatch, True)
    assert not [line for line in capsys.readouterr().err.splitlines() if "bn_relu" in line]
    plain = resnet(monkeypatch, False)
    np.testing.assert_allclose(fused.grads, plain.grads, rtol=1e-3, atol=1e-4)


def test_sync_batchnorm_keeps_its_split(fake):
    bn = bn_layer()
    bn.stat_reducer = lambda buf: None
    x = np.random.default_rng(1).standard_normal((2, 6, 6, 5)).astype(np.float32)
    assert bn.forward_relu(x, True) is None and bn.seam.kernel is None


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_real_half_arrays_cross_the_fused_and_cudnn_layers(fake, precision):
    half = nn.dtypes.half_dtype(precision)
    model = nn.build_model("resnet20", (3, 8, 8), 10, seed=1)
    model.set_precision(precision, real=True)
    seen = watch_outputs(model)
    x = np.random.default_rng(2).standard_normal((2, 3, 8, 8)).astype(np.float32)
    _, dlogits = nn.softmax_cross_entropy(model.forward(x), np.array([1, 7]))
    model.backward(dlogits)
    relu_bns, add_bns = block_norms(model)
    assert all(isinstance(bn.seam.kernel, FUSED) for bn in relu_bns + add_bns)
    crossings = [entry for entry in seen if entry[2] is not None]
    assert crossings and all(entry[1] == entry[2] == half for entry in crossings), crossings
    assert model.grads.dtype == np.float32 and np.isfinite(model.grads).all()


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_batchnorm_holds_its_input_for_backward_and_copies_it_only_to_change_its_dtype(
    monkeypatch, fused
):
    """A pass over each BatchNorm input per step saved: the graphs read x where it is (x is a
    convolution's output, which nothing changes before BatchNorm's backward has read it); a
    half input whose plan fell back to float32 is copied, as before."""
    refuse = (lambda op, dims, dtype: False) if fused else (lambda op, dims, dtype: op == "relu")
    install(monkeypatch, Module(refuse=refuse), stream=7, enable=True)
    bn = bn_layer()
    x = np.random.default_rng(1).standard_normal((2, 6, 6, 5)).astype(np.float32)
    bn.forward_relu(x, True) if fused else bn.forward(x)
    assert isinstance(bn.seam.kernel, FUSED) is fused
    assert bn._work.held("cudnn_x") is x
    bn.backward(np.ones_like(x))
    assert bn._work.last("cudnn_x") is None and bn._work.last("cudnn_dy") is None
    half = bn_layer("bf16")
    refuse_bf16 = lambda op, dims, dtype: dtype == "BFLOAT16"  # noqa: E731
    install(monkeypatch, Module(refuse=refuse_bf16), stream=7, enable=True)
    xh = x.astype(nn.dtypes.half_dtype("bf16"))
    half.forward_relu(xh, True) if fused else half.forward(xh)
    held = half._work.held("cudnn_x")
    assert held is not xh and held.dtype == np.float32  # the float32 plan's copy
