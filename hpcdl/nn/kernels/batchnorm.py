"""Fast kernels for BatchNorm (NOTE [fast kernels] in hpcdl/nn/kernels/__init__.py).

CudnnBatchNorm: training forward (batch statistics, running statistics updated in place with
PyTorch's momentum rule) and backward (dx, d gamma, d beta) as cuDNN frontend graphs in NHWC
(NOTE [cuDNN graphs] in hpcdl/nn/kernels/cudnn_graphs.py), on CuPy arrays with --gpu-kernels.
Statistics and the parameter gradients are float32; the plans' x, y, dy and dx are in the
layer's format, and y and dx come back in the dtype of x and dy (float32 emulated, the
format's with real half arrays, hpcdl.nn.dtypes).
Not with --sync-bn: cuDNN's fused graph cannot put the ranks' allreduce between the statistics
and the normalisation, so SyncBatchNorm keeps the reference. Evaluation is one elementwise pass
with the running statistics. Fusing the ReLU and the residual add that follow a BatchNorm
(cuDNN's BN+ReLU and BN+add+ReLU graphs) needs the blocks to hand the pair to one kernel; not
done yet. Where none applies, BatchNorm runs its own GEMV-sum code.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hpcdl.backend import array_module
from hpcdl.nn.kernels import cudnn_graphs
from hpcdl.nn.kernels.cudnn_graphs import Plan, PlanCache, PlanKey, nhwc

_FLOAT32 = np.dtype(np.float32)
# Each graph's inputs: the frontend's keyword, then our tensor's name (the arrays' key in run).
_TRAIN_INPUTS = (("input", "x"), ("scale", "scale"), ("bias", "bias"), ("in_running_mean",
                 "in_mean"), ("in_running_var", "in_var"), ("epsilon", "epsilon"),
                 ("momentum", "momentum"))  # fmt: skip
_BACKWARD_INPUTS = (("grad", "dy"), ("input", "x"), ("scale", "scale"), ("mean", "mean"),
                    ("inv_variance", "inv_var"))  # fmt: skip


class CudnnBatchNorm:
    """BatchNorm over (N, H, W, C) through cuDNN graphs; plans cached per shape."""

    name = "cudnn"

    def __init__(self) -> None:
        self.cache = PlanCache(self._build)

    def keys(self, layer: Any, x_shape: tuple[int, ...]) -> dict[str, PlanKey]:
        io = cudnn_graphs.io_dtype(layer.precision).name
        shapes = (tuple(x_shape), (layer.channels,))
        return {op: PlanKey(op, shapes, io) for op in ("bn_train", "bn_backward")}

    def applies(self, layer: Any, x: Any) -> bool:
        if cudnn_graphs.runtime_for(x) is None or x.ndim != 4 or not x.flags.c_contiguous:
            return False
        if layer.stat_reducer is not None:  # SyncBatchNorm: the reference (module docstring)
            return False
        return all(self.cache.get(key) is not None for key in self.keys(layer, x.shape).values())

    def forward(self, layer: Any, x: Any, train: bool) -> Any:
        xp = array_module(x)
        layer.train = train
        if not train:
            inv_std = 1.0 / xp.sqrt(layer.b["running_var"] + layer.eps)
            scale = layer.p["gamma"] * inv_std
            y = (x - layer.b["running_mean"]) * scale + layer.p["beta"]
            return y.astype(x.dtype, copy=False)
        rt, c = cudnn_graphs.runtime(), layer.channels
        train_plan = self.cache.get(self.keys(layer, x.shape)["bn_train"])
        io = train_plan.io  # the layer's format, or float32 where cuDNN had no half plan
        xs = layer._work.get("cudnn_x", x.shape, io, xp)  # kept for backward
        xs[...] = x
        mean = layer._work.get("cudnn_mean", (c,), _FLOAT32, xp)
        inv_var = layer._work.get("cudnn_inv_var", (c,), _FLOAT32, xp)
        y = xp.empty(x.shape, dtype=io)
        arrays = {
            "x": xs,
            "scale": layer.p["gamma"],
            "bias": layer.p["beta"],
            "in_mean": layer.b["running_mean"],
            "in_var": layer.b["running_var"],
            "out_mean": layer.b["running_mean"],  # updated in place, as the frontend allows
            "out_var": layer.b["running_var"],
            # host scalars, passed by value: the pack gets their host addresses, which cuDNN
            # reads at execute; kept with the layer, so a captured step never reads freed memory
            "epsilon": host_scalar(layer, "cudnn_epsilon", layer.eps),
            "momentum": host_scalar(layer, "cudnn_momentum", layer.momentum),
            "mean": mean,
            "inv_var": inv_var,
            "y": y,
        }
        rt.run(train_plan, arrays, xp)
        return y if io == x.dtype else y.astype(x.dtype)  # x's: float32 or the format's

    def backward(self, layer: Any, dy: Any) -> Any:
        rt, xp = cudnn_graphs.runtime(), array_module(dy)
        work = layer._work
        plan = self.cache.get(self.keys(layer, dy.shape)["bn_backward"])
        xs = cudnn_graphs.in_dtype(work, "cudnn_x", work.last("cudnn_x"), plan.io, xp)
        dys = work.get("cudnn_dy", dy.shape, plan.io, xp)
        dys[...] = dy
        dx = xp.empty(dy.shape, dtype=plan.io)
        arrays = {
            "dy": dys,
            "x": xs,
            "scale": layer.p["gamma"],
            "mean": work.last("cudnn_mean"),
            "inv_var": work.last("cudnn_inv_var"),
            "dx": dx,
            "dscale": layer.g["gamma"],  # float32, straight into the flat gradient buffer
            "dbias": layer.g["beta"],
        }
        rt.run(plan, arrays, xp)
        if not layer.input_grad:
            return None
        return dx if dx.dtype == dy.dtype else dx.astype(dy.dtype)

    def _build(self, key: PlanKey) -> Plan:
        rt = cudnn_graphs.runtime()
        x_shape, c_shape = key.shapes
        io = cudnn_graphs.dtype_named(key.io)
        g = rt.graph(io)

        def vec(name: str) -> Any:
            return rt.tensor(g, name, nhwc(c_shape), _FLOAT32)

        if key.op == "bn_train":
            t = {"x": rt.tensor(g, "x", nhwc(x_shape), io)}
            t.update({name: vec(name) for name in ("scale", "bias", "in_mean", "in_var")})
            t.update({name: rt.scalar(g, name) for name in ("epsilon", "momentum")})
            outs = g.batchnorm(name="bn", **{kw: t[name] for kw, name in _TRAIN_INPUTS})
            t.update(zip(("y", "mean", "inv_var", "out_mean", "out_var"), outs, strict=True))
            rt.output(t["y"], nhwc(x_shape), io)
            for name in ("mean", "inv_var", "out_mean", "out_var"):
                rt.output(t[name], nhwc(c_shape), _FLOAT32)
            return rt.finish(g, t, by_value=("epsilon", "momentum"))
        else:
            t = {name: rt.tensor(g, name, nhwc(x_shape), io) for name in ("dy", "x")}
            t.update({name: vec(name) for name in ("scale", "mean", "inv_var")})
            inputs = {kw: t[name] for kw, name in _BACKWARD_INPUTS}
            outs = g.batchnorm_backward(name="bn_backward", **inputs)
            t.update(zip(("dx", "dscale", "dbias"), outs, strict=True))
            rt.output(t["dx"], nhwc(x_shape), io)
            rt.output(t["dscale"], nhwc(c_shape), _FLOAT32)
            rt.output(t["dbias"], nhwc(c_shape), _FLOAT32)
        return rt.finish(g, t)


def host_scalar(layer: Any, name: str, value: float) -> np.ndarray:
    """A float32 (1, 1, 1, 1) host array holding value, kept in the layer's workspaces."""
    scalar = layer._work.get(name, (1, 1, 1, 1), _FLOAT32, np)
    scalar.fill(value)
    return scalar


KERNELS: list[Any] = [CudnnBatchNorm()]
