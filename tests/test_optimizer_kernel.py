"""hpcdl.nn.kernels.optimizer: FusedSGD's arithmetic is the reference SGD.step's, bit for bit
(checked on the CPU through its NumPy evaluation; marked gpu: the CuPy kernel itself)."""

import itertools

import numpy as np
import pytest

from hpcdl import nn
from hpcdl.backend import cupy_or_none, gpu_available
from hpcdl.nn import kernels
from hpcdl.nn.kernels.optimizer import FusedSGD, cuda_source, run_program, sgd_program

VARIANTS = [
    {"momentum": m, "nesterov": n, "weight_decay": wd, "masked": masked}
    for m, n, wd, masked in itertools.product([0.0, 0.9], [False, True], [0.0, 1e-3], [False, True])
    if not (n and not m) and not (masked and not wd)
]


def buffers(seed=0, n=4096, xp=np):
    rng = np.random.default_rng(seed)
    p = rng.standard_normal(n).astype(np.float32)
    g = (rng.standard_normal(n) * 10.0 ** rng.uniform(-8, 2, n)).astype(np.float32)
    g[:4] = [0.0, -0.0, 1e-38, -3e-39]  # signed zeros and subnormals
    mask = (rng.random(n) > 0.3).astype(np.float32)
    return xp.asarray(p), xp.asarray(g), xp.asarray(mask)


def reference_sgd(variant, p, g, mask, xp=np):
    opt = nn.optim.SGD(
        p,
        g,
        variant["momentum"],
        variant["nesterov"],
        variant["weight_decay"],
        mask if variant["masked"] else None,
    )
    return opt


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
@pytest.mark.parametrize("apply", [None, True, False])
def test_the_kernels_program_is_the_reference_update_bitwise(variant, apply):
    p, g, mask = buffers()
    opt = reference_sgd(variant, p.copy(), g, mask)
    program = sgd_program(
        bool(variant["weight_decay"]), bool(variant["momentum"]), variant["nesterov"]
    )
    v = np.zeros_like(p)
    for step, lr in enumerate([0.1, 0.05, 0.3]):
        flag = None if apply is None else np.asarray(apply if step != 1 else not apply)
        before = opt.params.copy(), opt.velocity.copy()
        opt.step(lr, flag)
        out = run_program(
            program,
            {
                "p": before[0], "v": v, "g": g,
                "mask": mask if variant["masked"] else np.float32(1.0),
                "wd": variant["weight_decay"], "m": variant["momentum"], "neg_lr": -lr,
            },
        )  # fmt: skip
        applies = True if flag is None else bool(flag)
        expected_p, v = (out["pn"], out["vn"]) if applies else before
        np.testing.assert_array_equal(opt.params, expected_p)
        np.testing.assert_array_equal(opt.velocity, v)


def test_the_cuda_source_rounds_every_operation_itself():
    source = cuda_source(sgd_program(True, True, True))
    assert "__fmul_rn(v, m)" in source and "__fadd_rn(vn, d)" in source
    assert " * " not in source and " + " not in source  # nothing the compiler could fuse
    assert "if (apply) { p = pn; v = vn; }" in source


def test_on_the_cpu_the_seam_keeps_the_reference(monkeypatch):
    monkeypatch.setattr(kernels, "_enabled", True)
    p, g, mask = buffers()
    opt = nn.make_optimizer("sgd", p, g, momentum=0.9)
    assert not FusedSGD().applies(opt, p)
    opt.step(0.1)
    assert opt.seam.kernel is None


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a GPU")
@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_the_fused_kernel_is_the_reference_bitwise_on_the_gpu(variant, monkeypatch):
    cp = cupy_or_none()
    p, g, mask = buffers(xp=cp)
    fused, plain = (
        reference_sgd(variant, p.copy(), g, mask),
        reference_sgd(variant, p.copy(), g, mask),
    )
    monkeypatch.setattr(kernels, "_enabled", True)
    for step, lr in enumerate([0.1, 0.05, 0.3]):
        flag = cp.asarray(step != 1)  # the middle step is skipped
        fused.step(lr, flag)
        assert fused.seam.kernel is not None and fused.seam.kernel.name == "fused-sgd"
        monkeypatch.setattr(kernels, "_enabled", False)
        plain.step(lr, flag)
        monkeypatch.setattr(kernels, "_enabled", True)
    np.testing.assert_array_equal(cp.asnumpy(fused.params), cp.asnumpy(plain.params))
    np.testing.assert_array_equal(cp.asnumpy(fused.velocity), cp.asnumpy(plain.velocity))
