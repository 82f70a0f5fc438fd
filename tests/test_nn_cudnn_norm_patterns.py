"""The stand-in cuDNN frontend (tests/fake_cudnn.py) fuses into BatchNorm's backward only what
cuDNN's norm engines take, as the frontend's own samples build them (its test/python/
test_batchnorm.py, samples/cpp/norm/batchnorm.cpp):
- DReluForkDBn: the ReLU's backward over BatchNorm's output recomputed in the graph
  (batchnorm_inference), its result typed in the I/O format;
- BnAddRelu: the ReLU's backward as a product with the forward's bitmask (cmp_gt's BOOLEAN
  output, packed eight elements to a byte), its result typed, and output for the shortcut.
A ReLU backward that reads a tensor of the graph (the post-ReLU activation), as hpcdl built it
until the H200 run of 2026-11-29, found no engine there for any shape in float32 or bf16
("No valid engine configs"), and the stand-in refuses it too."""

import numpy as np
import pytest
from fake_cudnn import Module, cudnnGraphNotSupportedError

N, C, HW = 2, 8, 3  # an (N, H, W, C) activation named [N, C, H, W]
DIM, STRIDE = [N, C, HW, HW], [HW * HW * C, 1, HW * C, C]
VEC = ([1, C, 1, 1], [C, 1, C, C])


def graph(module):
    dt = module.data_type
    return module.pygraph(io_data_type=dt.FLOAT, intermediate_data_type=dt.FLOAT,
                          compute_data_type=dt.FLOAT, handle=module.create_handle())  # fmt: skip


def act(g, name, dtype=None):
    return g.tensor(DIM, STRIDE, dtype or g.module.data_type.FLOAT, name=name)


def vec(g, name):
    return g.tensor(*VEC, g.module.data_type.FLOAT, name=name)


def backward_of(g, dpre, x, stats):
    """batchnorm_backward over dpre; its three outputs declared."""
    dx, dscale, dbias = g.batchnorm_backward(dpre, x, stats["scale"], stats["mean"],
                                             stats["inv_var"])  # fmt: skip
    dx.set_output(True).set_dim(DIM).set_stride(STRIDE).set_data_type(g.module.data_type.FLOAT)
    for t in (dscale, dbias):
        t.set_output(True).set_dim(VEC[0]).set_stride(VEC[1])
        t.set_data_type(g.module.data_type.FLOAT)
    return dx, dscale, dbias


def execute(module, g, pack):
    """g on the arrays of pack (tensor -> NumPy array), each put on the stand-in's device."""
    pointers = {t: module.pointer(a) for t, a in pack.items()}
    g.execute(pointers, module.pointer(np.zeros(64, np.uint8)), handle=module.create_handle())


def built(g):
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([g.module.heur_mode.A, g.module.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    return g


def test_a_relu_backward_reading_a_tensor_before_batchnorm_backward_is_refused():
    module = Module()
    g = graph(module)
    x, dz, z = act(g, "x"), act(g, "dz"), act(g, "z")
    stats = {name: vec(g, name) for name in ("scale", "mean", "inv_var")}
    dpre = g.relu_backward(loss=dz, input=z)
    dpre.set_data_type(module.data_type.FLOAT)
    backward_of(g, dpre, x, stats)
    with pytest.raises(cudnnGraphNotSupportedError, match="No valid engine configs"):
        built(g)


def test_an_untyped_relu_backward_result_is_refused_as_the_samples_type_it():
    module = Module()
    g = graph(module)
    x, dz = act(g, "x"), act(g, "dz")
    stats = {name: vec(g, name) for name in ("scale", "bias", "mean", "inv_var")}
    y = g.batchnorm_inference(x, stats["mean"], stats["inv_var"], stats["scale"], stats["bias"])
    backward_of(g, g.relu_backward(loss=dz, input=y), x, stats)
    with pytest.raises(cudnnGraphNotSupportedError, match="No valid engine configs"):
        built(g)


def reference_backward(x, dpre, scale, mean, inv_var):
    m = x.size // x.shape[-1]
    xhat = (x - mean) * inv_var
    dbias, dscale = dpre.sum(axis=(0, 1, 2)), (dpre * xhat).sum(axis=(0, 1, 2))
    return scale * inv_var * (dpre - dbias / m - xhat * dscale / m), dscale, dbias


def arrays(rng):
    nhwc = (N, HW, HW, C)
    x, dz = (rng.standard_normal(nhwc).astype(np.float32) for _ in range(2))
    scale, bias = rng.uniform(0.5, 1.5, C).astype(np.float32), rng.standard_normal(C)
    mean, inv_var = x.mean(axis=(0, 1, 2)), 1 / np.sqrt(x.var(axis=(0, 1, 2)) + 1e-5)
    return x, dz, scale, bias.astype(np.float32), mean.astype(np.float32), inv_var


def test_drelu_fork_dbn_recomputes_batchnorms_output_and_runs():
    module, rng = Module(), np.random.default_rng(0)
    g = graph(module)
    x, dz = act(g, "x"), act(g, "dz")
    stats = {name: vec(g, name) for name in ("scale", "bias", "mean", "inv_var")}
    y = g.batchnorm_inference(x, stats["mean"], stats["inv_var"], stats["scale"], stats["bias"])
    dpre = g.relu_backward(loss=dz, input=y).set_data_type(module.data_type.FLOAT)
    outs = backward_of(g, dpre, x, stats)
    built(g)
    xa, dza, scale, bias, mean, inv_var = arrays(rng)
    got = [np.zeros_like(xa), np.zeros(C, np.float32), np.zeros(C, np.float32)]
    pack = {x: xa, dz: dza, stats["scale"]: scale, stats["bias"]: bias, stats["mean"]: mean,
            stats["inv_var"]: inv_var.astype(np.float32), **dict(zip(outs, got))}  # fmt: skip
    execute(module, g, pack)
    dpre_ref = np.where((xa - mean) * inv_var * scale + bias > 0, dza, 0)
    for a, b in zip(got, reference_backward(xa, dpre_ref, scale, mean, inv_var), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_bn_add_relu_passes_its_relu_as_a_bitmask_packed_eight_to_a_byte():
    """Forward: cmp_gt over the ReLU's output writes a BOOLEAN bitmask (ceil(n / 8) bytes);
    backward: the loss scaled by it, output for the shortcut, into batchnorm_backward."""
    module, rng = Module(), np.random.default_rng(1)
    dt = module.data_type
    f = graph(module)
    pre, zeros = act(f, "pre"), act(f, "zeros")
    z = f.relu(input=pre).set_output(True).set_dim(DIM).set_stride(STRIDE).set_data_type(dt.FLOAT)
    mask = f.cmp_gt(input=z, comparison=zeros)
    mask.set_output(True).set_dim(DIM).set_stride(STRIDE).set_data_type(dt.BOOLEAN)
    built(f)
    pa = rng.standard_normal((N, HW, HW, C)).astype(np.float32)
    za, bits = np.zeros_like(pa), np.zeros(-(-pa.size // 8), np.uint8)
    inputs = {pre: pa, zeros: np.zeros_like(pa), z: za}
    with pytest.raises(ValueError, match="reach"):  # fewer bits than elements
        execute(module, f, {**inputs, mask: np.zeros(pa.size // 9, np.uint8)})
    execute(module, f, {**inputs, mask: bits})
    assert np.array_equal(np.unpackbits(bits, bitorder="little")[: pa.size], pa.ravel() > 0)
    g = graph(module)
    x, dz, m = act(g, "x"), act(g, "dz"), act(g, "mask", dt.BOOLEAN)
    stats = {name: vec(g, name) for name in ("scale", "mean", "inv_var")}
    dpre = g.scale(input=dz, scale=m).set_data_type(dt.FLOAT)
    dpre.set_output(True).set_dim(DIM).set_stride(STRIDE)
    outs = backward_of(g, dpre, x, stats)
    built(g)
    xa, dza, scale, _, mean, inv_var = arrays(rng)
    got = [np.zeros_like(xa), np.zeros(C, np.float32), np.zeros(C, np.float32)]
    dpre_got = np.zeros_like(xa)
    pack = {x: xa, dz: dza, m: bits, stats["scale"]: scale, stats["mean"]: mean,
            stats["inv_var"]: inv_var.astype(np.float32), dpre: dpre_got,
            **dict(zip(outs, got))}  # fmt: skip
    execute(module, g, pack)
    dpre_ref = np.where(pa > 0, dza, 0)
    np.testing.assert_array_equal(dpre_got, dpre_ref)
    for a, b in zip(got, reference_backward(xa, dpre_ref, scale, mean, inv_var), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_a_bitmask_is_a_boolean_output_of_cmp_gt_over_a_tensor_of_its_shape():
    module = Module()
    g = graph(module)
    pre, zeros = act(g, "pre"), act(g, "zeros")
    z = g.relu(input=pre).set_output(True).set_dim(DIM).set_stride(STRIDE)
    z.set_data_type(module.data_type.FLOAT)
    mask = g.cmp_gt(input=z, comparison=zeros)
    mask.set_output(True).set_dim(DIM).set_stride(STRIDE).set_data_type(module.data_type.FLOAT)
    with pytest.raises(cudnnGraphNotSupportedError, match="BOOLEAN"):
        built(g)
