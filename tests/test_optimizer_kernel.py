"""hpcdl.nn.kernels.optimizer: FusedSGD's and FusedAdam's arithmetic is the reference SGD.step's
and Adam.step's, bit for bit (checked on the CPU through its NumPy evaluation, and the fused
steps with that evaluation, or the kernels' own CUDA source built for the CPU, standing in for
the CuPy kernel; marked gpu: the kernels)."""

import itertools

import numpy as np
import pytest
from cuda_on_cpu import CpuKernel

from hpcdl import nn
from hpcdl.backend import cupy_or_none, gpu_available
from hpcdl.nn import kernels
from hpcdl.nn.kernels import optimizer as optimizer_kernels
from hpcdl.nn.kernels.optimizer import (
    FusedAdam,
    FusedSGD,
    adam_program,
    adam_scalars,
    cuda_source,
    kernel_source,
    numpy_kernel,
    run_program,
    sgd_program,
)

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


@pytest.fixture(scope="module", params=["program", "cuda source"])
def stand_in(request, tmp_path_factory):
    """What runs in the CuPy kernel's place: its program evaluated by NumPy, or its own CUDA
    source built for the CPU (tests/cuda_on_cpu.py), 0-d arguments passed by value."""
    if request.param == "program":
        return lambda xp, family, key: numpy_kernel(family, key)
    folder, built = tmp_path_factory.mktemp("optimizer_kernels"), {}

    def compiled(xp, family, key):
        inputs, outputs, body = kernel_source(family, key)
        names = [part.split()[-1] for part in f"{inputs}, {outputs}".split(",")]

        def launch(*arguments):
            scalars = frozenset(n for n, a in zip(names, arguments, strict=True) if np.ndim(a) == 0)
            if (family, key, scalars) not in built:
                built[family, key, scalars] = CpuKernel(
                    inputs, outputs, body, "", folder, scalars=scalars
                )
            values = [a.item() if np.ndim(a) == 0 else a for a in arguments]
            size = next(a.size for a in arguments if np.ndim(a) > 0)
            built[family, key, scalars](*values, size=size)

        return launch

    return compiled


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


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_fused_sgds_step_with_its_program_for_kernel_is_the_reference_bitwise(
    monkeypatch, variant, stand_in
):
    """FusedSGD.step itself (its arguments, in the kernel's order) with the program's NumPy
    evaluation, or the kernel's CUDA built for the CPU, standing in for the CuPy kernel,
    against SGD.step; the second step skipped."""
    monkeypatch.setattr(FusedSGD, "applies", lambda self, opt, params: True)
    monkeypatch.setattr(optimizer_kernels, "_cupy_kernel", stand_in)
    p, g, mask = buffers()
    fused, plain = (reference_sgd(variant, p.copy(), g, mask) for _ in range(2))
    for step, lr in enumerate([0.1, 0.05, 0.3]):
        flag = None if step == 0 else np.asarray(step != 1)
        monkeypatch.setattr(kernels, "_enabled", True)
        fused.step(lr, flag)
        assert fused.seam.kernel is not None and fused.seam.kernel.name == "fused-sgd"
        monkeypatch.setattr(kernels, "_enabled", False)
        plain.step(lr, flag)
        np.testing.assert_array_equal(fused.params, plain.params)
        np.testing.assert_array_equal(fused.velocity, plain.velocity)


def test_the_cuda_source_rounds_every_operation_itself():
    source = cuda_source(sgd_program(True, True, True))
    assert "__fmul_rn(v, m)" in source and "__fadd_rn(vn, d)" in source
    assert " * " not in source and " + " not in source  # nothing the compiler could fuse
    assert "if (apply) { p = pn; v = vn; }" in source


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_on_the_cpu_the_seam_keeps_the_reference(monkeypatch, name):
    monkeypatch.setattr(kernels, "_enabled", True)
    p, g, mask = buffers()
    opt = nn.make_optimizer(name, p, g, momentum=0.9)
    assert not FusedSGD().applies(opt, p) and not FusedAdam().applies(opt, p)
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


ADAM_VARIANTS = [
    {"name": name, "weight_decay": wd, "masked": masked}
    for name, wd, masked in itertools.product(["adam", "adamw"], [0.0, 1e-2], [False, True])
    if not (masked and not wd)
]
LRS = [0.01, 0.003, 0.1, 0.02, 0.05]


def reference_adam(variant, p, g, mask):
    mask = mask if variant["masked"] else None
    return nn.make_optimizer(
        variant["name"], p, g, weight_decay=variant["weight_decay"], decay_mask=mask
    )


def apply_flag(apply, step, xp=np):
    """None (the plain step), or a device flag: `apply`, but not on the second step."""
    return None if apply is None else xp.asarray(apply if step != 1 else not apply)


@pytest.mark.parametrize("variant", ADAM_VARIANTS, ids=str)
@pytest.mark.parametrize("apply", [None, True, False])
def test_adams_program_is_the_reference_update_bitwise(variant, apply):
    """Every step's program, fed the scalars as Adam computes them (the step count on the host
    for a plain step, a float64 device scalar for a masked one), is Adam.step's update."""
    p, g, mask = buffers()
    opt = reference_adam(variant, p.copy(), g, mask)
    wd = bool(variant["weight_decay"])
    program = adam_program(wd, wd and variant["name"] == "adamw", variant["masked"])
    m, v, taken = np.zeros_like(p), np.zeros_like(p), 0
    for step, lr in enumerate(LRS):
        flag = apply_flag(apply, step)
        before = opt.params.copy(), opt.m.copy(), opt.v.copy()
        opt.step(lr, flag)
        t = taken + 1 if flag is None else np.float64(taken + 1)
        values = {"p": before[0], "m": m, "v": v, "g": g, "mask": mask if variant["masked"] else 1}
        out = run_program(program, values | adam_scalars(opt, lr, t))
        applies = flag is None or bool(flag)
        expected_p, m, v = (out["pn"], out["mn"], out["vn"]) if applies else before
        taken += applies
        np.testing.assert_array_equal(opt.params, expected_p)
        np.testing.assert_array_equal(opt.m, m)
        np.testing.assert_array_equal(opt.v, v)
        assert opt.t == taken


@pytest.mark.parametrize("variant", ADAM_VARIANTS, ids=str)
@pytest.mark.parametrize("apply", [None, True, False])
def test_fused_adams_step_with_its_program_for_kernel_is_the_reference_bitwise(
    monkeypatch, variant, apply, stand_in
):
    """FusedAdam.step itself (its scalars, its step count, the apply mask) with the program's
    NumPy evaluation, or the kernel's CUDA built for the CPU, standing in for the CuPy kernel,
    against the reference step for step; its count a device scalar once a masked step made it
    one, and checkpointed as the host's."""
    monkeypatch.setattr(FusedAdam, "applies", lambda self, opt, params: True)
    monkeypatch.setattr(optimizer_kernels, "_cupy_kernel", stand_in)
    p, g, mask = buffers()
    fused, plain = (reference_adam(variant, p.copy(), g, mask) for _ in range(2))
    for step, lr in enumerate(LRS):
        g[...] = buffers(seed=step + 1)[1]
        monkeypatch.setattr(kernels, "_enabled", True)
        fused.step(lr, apply_flag(apply, step))
        assert fused.seam.kernel is not None and fused.seam.kernel.name == "fused-adam"
        monkeypatch.setattr(kernels, "_enabled", False)
        plain.step(lr, apply_flag(apply, step))
        for name in ("params", "m", "v"):
            np.testing.assert_array_equal(getattr(fused, name), getattr(plain, name))
        assert fused.t == plain.t and (fused._t_device is None) == (apply is None)
    taken = {None: len(LRS), True: len(LRS) - 1, False: 1}[apply]  # the second step flips
    assert int(fused.state_dict()["t"]) == plain.t == taken


def test_adams_cuda_source_rounds_every_operation_itself():
    source = cuda_source(adam_program(True, True, True), ("p", "m", "v"))
    for call in ("__fsub_rn(p, d)", "__fsqrt_rn(d)", "__fdiv_rn(mn, d)", "__fmul_rn(gd, gd)"):
        assert call in source
    assert not any(f" {op} " in source for op in "*+-/")  # nothing the compiler could fuse
    assert "if (apply) { p = pn; m = mn; v = vn; }" in source


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a GPU")
@pytest.mark.parametrize("variant", ADAM_VARIANTS, ids=str)
@pytest.mark.parametrize("apply", [None, True])
def test_fused_adam_is_the_reference_bitwise_on_the_gpu(variant, apply, monkeypatch):
    """The plain step's count on the host, the masked step's on the device, in both."""
    cp = cupy_or_none()
    p, g, mask = buffers(xp=cp)
    fused, plain = (reference_adam(variant, p.copy(), g, mask) for _ in range(2))
    for step, lr in enumerate(LRS):
        monkeypatch.setattr(kernels, "_enabled", True)
        fused.step(lr, apply_flag(apply, step, cp))
        assert fused.seam.kernel is not None and fused.seam.kernel.name == "fused-adam"
        monkeypatch.setattr(kernels, "_enabled", False)
        plain.step(lr, apply_flag(apply, step, cp))
    for name in ("params", "m", "v"):
        np.testing.assert_array_equal(
            cp.asnumpy(getattr(fused, name)), cp.asnumpy(getattr(plain, name))
        )
    assert fused.t == plain.t
