"""Fused optimizer updates (NOTE [fast kernels] in hpcdl/nn/kernels/__init__.py).

An optimizer kernel has `applies(optimizer, params)` and `step(optimizer, lr, apply)` in place
of forward and backward. FusedSGD: SGD's decay, momentum, step and fp16's device "apply" mask
in one CuPy ElementwiseKernel, one pass over the flat buffers instead of five or more.
FusedAdam: Adam's and AdamW's (coupled or decoupled decay, masked or not, the apply mask).

The kernel's arithmetic is a program (sgd_program, adam_program): a list of float32
operations, each rounded on its own, in the reference's order (hpcdl.nn.optim). The same list
is written out as CUDA (with __fmul_rn, __fadd_rn, __fsub_rn, __fdiv_rn, __fsqrt_rn: each
correctly rounded, and the compiler fuses nothing into an FMA, which would round once where the
reference rounds twice) and evaluated with NumPy (run_program), which is how a CPU test checks
the arithmetic the GPU runs against the reference, bit for bit. What the reference computes
once per step in float64 (Python floats, or float64 device scalars) and rounds to float32 once,
the bias corrections and the decay factors, is computed the same way outside the kernel
(adam_scalars) and handed to it as float32 scalars: 0-d device arrays when the step count (or
the learning rate, in a step graph) is a device scalar, so nothing reads the host.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hpcdl.backend import array_module

# One operation: (target, op, a, b); op "mul", "add", "sub", "div" (float32, rounded), "sqrt"
# (of a, rounded) or "copy" (a).
Operation = tuple[str, str, str, str]

_NUMPY_OPS = {"mul": np.multiply, "add": np.add, "sub": np.subtract, "div": np.divide}
_CUDA_OPS = {
    "mul": "__fmul_rn",
    "add": "__fadd_rn",
    "sub": "__fsub_rn",
    "div": "__fdiv_rn",
    "sqrt": "__fsqrt_rn",
}


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


def adam_program(weight_decay: bool, decoupled: bool, masked: bool) -> list[Operation]:
    """Adam.step's (and _masked_step's) arithmetic for one element: reads p, m, v, g, mask and
    adam_scalars' keep, wd, b1, c1, b2, c2, corr, eps, neg_step; writes pn, mn and vn."""
    if weight_decay and decoupled and not masked:  # AdamW: p *= 1 - lr*wd
        ops = [("pn", "mul", "p", "keep"), ("gd", "copy", "g", "")]
    elif weight_decay and decoupled:  # p -= lr*wd * p * mask
        ops = [("d", "mul", "p", "wd"), ("d", "mul", "d", "mask"), ("pn", "sub", "p", "d")]
        ops.append(("gd", "copy", "g", ""))
    elif weight_decay:  # Adam's L2: gd = wd * p (* mask) + g
        ops = [("pn", "copy", "p", ""), ("gd", "mul", "p", "wd")]
        ops += [("gd", "mul", "gd", "mask")] if masked else []
        ops.append(("gd", "add", "gd", "g"))
    else:
        ops = [("pn", "copy", "p", ""), ("gd", "copy", "g", "")]
    return ops + [
        ("mn", "mul", "m", "b1"), ("t", "mul", "c1", "gd"), ("mn", "add", "mn", "t"),
        ("vn", "mul", "v", "b2"), ("t", "mul", "gd", "gd"), ("t", "mul", "c2", "t"),
        ("vn", "add", "vn", "t"),
        # p += (-lr / (1 - beta1**t)) * m / (sqrt(v * 1/(1 - beta2**t)) + eps)
        ("d", "mul", "vn", "corr"), ("d", "sqrt", "d", ""), ("d", "add", "d", "eps"),
        ("d", "div", "mn", "d"), ("d", "mul", "d", "neg_step"), ("pn", "add", "pn", "d"),
    ]  # fmt: skip


def run_program(ops: list[Operation], values: dict[str, Any]) -> dict[str, Any]:
    """Evaluate a program with NumPy float32 arithmetic; returns the values it ends with."""
    env = {k: np.asarray(v, np.float32) for k, v in values.items()}
    for target, op, a, b in ops:
        if op == "copy":
            env[target] = env[a].copy()
        elif op == "sqrt":
            env[target] = np.sqrt(env[a])
        else:
            env[target] = _NUMPY_OPS[op](env[a], env[b])
    return env


def cuda_source(ops: list[Operation], kept: tuple[str, ...] = ("p", "v")) -> str:
    """The program as the body of an ElementwiseKernel over `kept` in place: each `x` takes
    the program's `xn` where the step applies."""
    names = list(dict.fromkeys(target for target, *_ in ops))
    lines = [f"float {', '.join(names)};"]
    for target, op, a, b in ops:
        if op == "copy":
            lines.append(f"{target} = {a};")
        else:
            args = a if op == "sqrt" else f"{a}, {b}"
            lines.append(f"{target} = {_CUDA_OPS[op]}({args});")
    lines.append("if (apply) { " + " ".join(f"{x} = {x}n;" for x in kept) + " }")
    return "\n".join(lines)


# (inputs, in-place outputs, program) of each kernel; the argument order of its calls
_SPECS: dict[str, tuple[str, str, Any]] = {
    "sgd": (
        "float32 g, float32 mask, float32 wd, float32 m, float32 neg_lr, bool apply",
        "float32 p, float32 v",
        sgd_program,
    ),
    "adam": (
        "float32 g, float32 mask, float32 keep, float32 wd, float32 b1, float32 c1, "
        "float32 b2, float32 c2, float32 corr, float32 eps, float32 neg_step, bool apply",
        "float32 p, float32 m, float32 v",
        adam_program,
    ),
}
_CUPY_KERNELS: dict[tuple[str, tuple[bool, ...]], Any] = {}  # built on first use: needs a GPU


def _names(arguments: str) -> list[str]:
    return [argument.split()[-1] for argument in arguments.split(",")]


def kernel_source(family: str, key: tuple[bool, ...]) -> tuple[str, str, str]:
    """(in_params, out_params, body) of a family's kernel ("sgd", "adam") for its key."""
    inputs, outputs, program = _SPECS[family]
    return inputs, outputs, cuda_source(program(*key), tuple(_names(outputs)))


def _cupy_kernel(cp: Any, family: str, key: tuple[bool, ...]) -> Any:
    if (family, key) not in _CUPY_KERNELS:
        _CUPY_KERNELS[family, key] = cp.ElementwiseKernel(
            *kernel_source(family, key),
            f"hpcdl_fused_{family}_" + "".join(str(int(k)) for k in key),
        )
    return _CUPY_KERNELS[family, key]


def numpy_kernel(family: str, key: tuple[bool, ...]) -> Any:
    """The CuPy kernel's stand-in on NumPy, called as it is: its program run by run_program,
    the outputs written in place where `apply` (tests run a kernel's step() with it)."""
    inputs, outputs, program = _SPECS[family]
    ops, names, kept = program(*key), _names(inputs) + _names(outputs), _names(outputs)

    def launch(*arguments: Any) -> None:
        values = dict(zip(names, arguments, strict=True))
        apply = np.asarray(values.pop("apply"))
        env = run_program(ops, values)
        for name in kept:
            np.copyto(values[name], env[name + "n"], where=apply)

    return launch


class _FusedUpdate:
    """What the optimizer kernels share: each takes its hpcdl.nn.optim class (`optimizer`,
    by name) over CuPy float32 buffers, and has step() in place of forward and backward."""

    optimizer = ""

    def applies(self, optimizer: Any, params: Any) -> bool:
        from hpcdl.nn import optim  # optim imports this seam: import here

        return (
            isinstance(optimizer, getattr(optim, self.optimizer))
            and array_module(params) is not np
            and params.dtype == np.float32
        )

    def forward(self, layer: Any, x: Any, train: bool) -> Any:
        raise TypeError("an optimizer kernel has step(), not forward()")

    def backward(self, layer: Any, dy: Any) -> Any:
        raise TypeError("an optimizer kernel has step(), not backward()")


class FusedSGD(_FusedUpdate):
    """SGD (momentum, Nesterov, masked weight decay, fp16's apply flag) in one kernel, CuPy
    float32 buffers."""

    name = "fused-sgd"
    optimizer = "SGD"

    def step(self, optimizer: Any, lr: Any, apply: Any = None) -> None:
        xp = array_module(optimizer.params)
        key = (bool(optimizer.weight_decay), bool(optimizer.momentum), optimizer.nesterov)
        mask = optimizer.decay_mask if optimizer.decay_mask is not None else np.float32(1.0)
        flag = np.bool_(True) if apply is None else apply
        _cupy_kernel(xp, "sgd", key)(
            optimizer.grads,
            mask,
            np.float32(optimizer.weight_decay),
            np.float32(optimizer.momentum),
            -lr if not isinstance(lr, float | int) else np.float32(-lr),
            flag,
            optimizer.params,
            optimizer.velocity,
        )


ADAM_SCALARS = ("keep", "wd", "b1", "c1", "b2", "c2", "corr", "eps", "neg_step")  # in call order


def adam_scalars(optimizer: Any, lr: Any, t: Any) -> dict[str, Any]:
    """The scalars adam_program reads, each computed as Adam.step computes it (Python floats;
    float64 device scalars where lr or the step count t is one) and rounded to float32 once."""
    wd = optimizer.weight_decay
    values = {
        "keep": 1.0 - lr * wd if wd and optimizer.decoupled else 1.0,
        "wd": (lr * wd if optimizer.decoupled else wd) if wd else 0.0,
        "b1": optimizer.beta1,
        "c1": 1.0 - optimizer.beta1,
        "b2": optimizer.beta2,
        "c2": 1.0 - optimizer.beta2,
        "corr": 1.0 / (1.0 - optimizer.beta2**t),
        "eps": optimizer.eps,
        "neg_step": -lr / (1.0 - optimizer.beta1**t),
    }
    return {name: _float32(value) for name, value in values.items()}


def _on_host(value: Any) -> bool:
    """A host number (lr, a scalar), not a device scalar."""
    return isinstance(value, float | int | np.generic)


def _float32(value: Any) -> Any:
    """A float rounded to float32 on the host; a device scalar rounded where it is."""
    return np.float32(value) if _on_host(value) else value.astype(np.float32)


class FusedAdam(_FusedUpdate):
    """Adam and AdamW (coupled or decoupled, masked weight decay, fp16's apply flag) in one
    kernel over CuPy float32 buffers; the step count and bias corrections on the device once
    the count is there (a masked step, a step graph's device lr), as Adam._masked_step's are.

    The bias corrections are float64 powers: on the host Python's pow, on the device CUDA's.
    They may differ by an ulp in float64 (seldom in the float32 they are rounded to), so a
    step counted on the device matches the reference's masked step, whose arithmetic is the
    same, and a host-counted step the reference's plain step."""

    name = "fused-adam"
    optimizer = "Adam"  # AdamW too: its subclass

    def step(self, optimizer: Any, lr: Any, apply: Any = None) -> None:
        """One update; the count on the device when apply or lr is a device scalar or the
        count is there already (then no host read, and the count advances by apply)."""
        xp = array_module(optimizer.params)
        on_device = apply is not None or optimizer._t_device is not None or not _on_host(lr)
        if on_device:
            t = (optimizer.count_on_device() + 1).astype(xp.float64)
        else:
            t = optimizer._t + 1
        scalars = adam_scalars(optimizer, lr, t)
        wd = bool(optimizer.weight_decay)
        key = (wd, wd and optimizer.decoupled, wd and optimizer.decay_mask is not None)
        mask = optimizer.decay_mask if key[2] else np.float32(1.0)
        _cupy_kernel(xp, "adam", key)(
            optimizer.grads,
            mask,
            *(scalars[name] for name in ADAM_SCALARS),
            np.bool_(True) if apply is None else apply,
            optimizer.params,
            optimizer.m,
            optimizer.v,
        )
        if on_device:
            optimizer._t_device += 1 if apply is None else apply
        else:
            optimizer._t = t


KERNELS: list[Any] = [FusedSGD(), FusedAdam()]
