"""Fused optimizer updates (NOTE [fast kernels] in hpcdl/nn/kernels/__init__.py).

An optimizer kernel has `applies(optimizer, params)` and `step(optimizer, lr, apply)` in place
of forward and backward. FusedSGD: SGD's decay, momentum, step and fp16's device "apply" mask
in one CuPy ElementwiseKernel, one pass over the flat buffers instead of five or more.

The kernel's arithmetic is a program (sgd_program): a list of float32 operations, each rounded
on its own, in the reference's order (hpcdl.nn.optim.SGD.step). The same list is written out as
CUDA (with __fmul_rn / __fadd_rn, so the compiler fuses nothing into an FMA, which would round
once where the reference rounds twice) and evaluated with NumPy (run_program), which is how a
CPU test checks the arithmetic the GPU runs against the reference, bit for bit.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hpcdl.backend import array_module

# One operation: (target, op, a, b); op "mul" or "add" (float32, rounded), or "copy" (a).
Operation = tuple[str, str, str, str]


def sgd_program(weight_decay: bool, momentum: bool, nesterov: bool) -> list[Operation]:
    """SGD.step's arithmetic for one element: reads p, v, g, mask, wd, m, neg_lr; writes
    pn and vn (the parameter and velocity when the step applies)."""
    ops: list[Operation] = []
    if weight_decay:  # d = wd * p * mask + g
        ops += [("d", "mul", "p", "wd"), ("d", "mul", "d", "mask"), ("d", "add", "d", "g")]
    else:
        ops.append(("d", "copy", "g", ""))
    if momentum:  # vn = m * v + d; d = vn (Nesterov: d + m * vn)
        ops += [("vn", "mul", "v", "m"), ("vn", "add", "vn", "d")]
        if nesterov:
            ops += [("t", "mul", "vn", "m"), ("d", "add", "d", "t")]
        else:
            ops.append(("d", "copy", "vn", ""))
    else:
        ops.append(("vn", "copy", "v", ""))
    ops += [("d", "mul", "d", "neg_lr"), ("pn", "add", "p", "d")]
    return ops


def run_program(ops: list[Operation], values: dict[str, Any]) -> dict[str, Any]:
    """Evaluate a program with NumPy float32 arithmetic; returns the values it ends with."""
    env = {k: np.asarray(v, np.float32) for k, v in values.items()}
    for target, op, a, b in ops:
        if op == "copy":
            env[target] = env[a].copy()
        else:
            env[target] = (np.multiply if op == "mul" else np.add)(env[a], env[b])
    return env


def cuda_source(ops: list[Operation]) -> str:
    """The program as the body of an ElementwiseKernel over (p, v) in place."""
    lines = ["float d, t, vn, pn;"]
    for target, op, a, b in ops:
        fn = {"mul": "__fmul_rn", "add": "__fadd_rn"}.get(op)
        lines.append(f"{target} = {fn}({a}, {b});" if fn else f"{target} = {a};")
    lines.append("if (apply) { p = pn; v = vn; }")
    return "\n".join(lines)


_CUPY_KERNELS: dict[tuple[bool, bool, bool], Any] = {}  # built on first use: needs a GPU


def _cupy_kernel(cp: Any, key: tuple[bool, bool, bool]) -> Any:
    if key not in _CUPY_KERNELS:
        _CUPY_KERNELS[key] = cp.ElementwiseKernel(
            "float32 g, float32 mask, float32 wd, float32 m, float32 neg_lr, bool apply",
            "float32 p, float32 v",
            cuda_source(sgd_program(*key)),
            "hpcdl_fused_sgd_" + "".join(str(int(k)) for k in key),
        )
    return _CUPY_KERNELS[key]


class FusedSGD:
    """SGD (momentum, Nesterov, masked weight decay, fp16's apply flag) in one kernel, CuPy
    float32 buffers."""

    name = "fused-sgd"

    def applies(self, optimizer: Any, params: Any) -> bool:
        from hpcdl.nn.optim import SGD  # optim imports this seam: import here

        return (
            isinstance(optimizer, SGD)
            and array_module(params) is not np
            and params.dtype == np.float32
        )

    def forward(self, layer: Any, x: Any, train: bool) -> Any:
        raise TypeError("an optimizer kernel has step(), not forward()")

    def backward(self, layer: Any, dy: Any) -> Any:
        raise TypeError("an optimizer kernel has step(), not backward()")

    def step(self, optimizer: Any, lr: Any, apply: Any = None) -> None:
        xp = array_module(optimizer.params)
        key = (bool(optimizer.weight_decay), bool(optimizer.momentum), optimizer.nesterov)
        mask = optimizer.decay_mask if optimizer.decay_mask is not None else np.float32(1.0)
        flag = np.bool_(True) if apply is None else apply
        _cupy_kernel(xp, key)(
            optimizer.grads,
            mask,
            np.float32(optimizer.weight_decay),
            np.float32(optimizer.momentum),
            -lr if not isinstance(lr, float | int) else np.float32(-lr),
            flag,
            optimizer.params,
            optimizer.velocity,
        )


KERNELS: list[Any] = [FusedSGD()]
