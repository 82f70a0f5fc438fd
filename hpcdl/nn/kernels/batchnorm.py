"""Fast kernels for BatchNorm (NOTE [fast kernels] in hpcdl/nn/kernels/__init__.py).

CudnnBatchNorm: training forward (batch statistics, running statistics updated in place with
PyTorch's momentum rule) and backward (dx, d gamma, d beta) as cuDNN frontend graphs in NHWC
(NOTE [cuDNN graphs] in hpcdl/nn/kernels/cudnn_graphs.py), on CuPy arrays with --gpu-kernels.
Statistics and the parameter gradients are float32; the plans' x, y, dy and dx are in the
layer's format, and y and dx come back in the dtype of x and dy (float32 emulated, the
format's with real half arrays, hpcdl.nn.dtypes).
Not for a float64 model: cuDNN's graph API documents BatchNorm for float32 and half I/O with
float32 statistics, and no float64 engine, so a float64 BatchNorm keeps the reference (said
once) rather than have its statistics run in float32. Not with --sync-bn: cuDNN's fused graph
cannot put the ranks' allreduce between the statistics and the normalisation, so SyncBatchNorm
keeps the reference. Evaluation is one elementwise pass with the running statistics. Where none
applies, BatchNorm runs its own GEMV-sum code.

CudnnBatchNormRelu: the same training BatchNorm with the ReLU that follows it, and the residual
add before that ReLU (a ResNet block's end), in one forward and one backward graph each. A
container asks for it (BatchNorm.forward_relu) on a BN -> ReLU or BN -> add -> ReLU pattern in
training; cuDNN takes the fused graphs or refuses them per shape (PlanCache), and a refused
shape runs CudnnBatchNorm, then the ReLU, as before. Not for SyncBatchNorm: its split
(statistics, allreduce, finalize) stays the reference's.

NOTE [fused BatchNorm backward]
cuDNN's norm engines fuse only two ReLU backwards into BatchNorm's (the patterns of the
frontend's test/python/test_batchnorm.py and samples/cpp/norm/batchnorm.cpp), the fused result
typed in the I/O format:
- BN -> ReLU (DReluForkDBn): the backward graph recomputes BatchNorm's output from x and the
  saved statistics (batchnorm_inference), takes the ReLU's backward over it, then BatchNorm's;
  the forward is batchnorm, relu;
- BN -> add -> ReLU (BnAddRelu): the forward also writes the ReLU's bitmask (cmp_gt of its
  output against zeros, a BOOLEAN tensor packed eight elements to a byte, which only cuDNN
  reads), and the backward scales the loss by it, an output too (the shortcut's gradient),
  then runs BatchNorm's backward.
A ReLU backward that reads the post-ReLU activation as a tensor, as built until the H200 run
of 2026-11-29, found no engine for any shape there, in float32 or bf16 ("No valid engine
configs"), so every fused layer had run unfused; tests/fake_cudnn.py now refuses it too.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hpcdl.backend import array_module
from hpcdl.nn.kernels import cudnn_graphs, say_once
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
        if layer.p["gamma"].dtype == np.float64:  # no float64 engine (module docstring)
            say_once(
                "cudnn-bn-float64",
                "--gpu-kernels: cuDNN's graphs have no float64 BatchNorm; a float64 model's "
                "BatchNorm runs hpcdl's own float64 kernel",
            )
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
        xs = cudnn_graphs.kept(layer._work, "cudnn_x", x, io, xp)  # for backward
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
        xs = cudnn_graphs.in_dtype(work, "cudnn_x", work.held("cudnn_x"), plan.io, xp)
        dys = cudnn_graphs.operand(work, "cudnn_dy", dy, plan.io, xp)
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
            return rt.finish(g, t, io, by_value=("epsilon", "momentum"))
        else:
            t = {name: rt.tensor(g, name, nhwc(x_shape), io) for name in ("dy", "x")}
            t.update({name: vec(name) for name in ("scale", "mean", "inv_var")})
            inputs = {kw: t[name] for kw, name in _BACKWARD_INPUTS}
            outs = g.batchnorm_backward(name="bn_backward", **inputs)
            t.update(zip(("dx", "dscale", "dbias"), outs, strict=True))
            rt.output(t["dx"], nhwc(x_shape), io)
            rt.output(t["dscale"], nhwc(c_shape), _FLOAT32)
            rt.output(t["dbias"], nhwc(c_shape), _FLOAT32)
        return rt.finish(g, t, io)


def host_scalar(layer: Any, name: str, value: float) -> np.ndarray:
    """A float32 (1, 1, 1, 1) host array holding value, kept in the layer's workspaces."""
    scalar = layer._work.get(name, (1, 1, 1, 1), _FLOAT32, np)
    scalar.fill(value)
    return scalar


class CudnnBatchNormRelu(CudnnBatchNorm):
    """relu(batchnorm(x) [+ residual]) in training through fused cuDNN graphs (module doc)."""

    name = "cudnn-bn-relu"
    fuses_relu = True

    def __init__(self) -> None:
        self.cache = PlanCache(self._build, refused="BatchNorm and its ReLU run unfused")

    def keys(self, layer: Any, x_shape: tuple[int, ...]) -> dict[str, PlanKey]:
        tail = "bn_add_relu" if layer.residual is not None else "bn_relu"
        io = cudnn_graphs.io_dtype(layer.precision).name
        shapes = (tuple(x_shape), (layer.channels,))
        return {op: PlanKey(f"{tail}_{op}", shapes, io) for op in ("train", "backward")}

    def applies(self, layer: Any, x: Any) -> bool:
        if not layer.fuse_relu or layer.residual is not None and layer.residual.shape != x.shape:
            return False
        return super().applies(layer, x)

    def forward(self, layer: Any, x: Any, train: bool) -> Any:
        xp = array_module(x)
        rt, c, train_plan = cudnn_graphs.runtime(), layer.channels, self._plan(layer, x, "train")
        io = train_plan.io
        z = xp.empty(x.shape, dtype=io)  # the output: the backward graphs do not read it
        arrays = {
            "x": cudnn_graphs.kept(layer._work, "cudnn_x", x, io, xp),
            "scale": layer.p["gamma"],
            "bias": layer.p["beta"],
            "in_mean": layer.b["running_mean"],
            "in_var": layer.b["running_var"],
            "out_mean": layer.b["running_mean"],
            "out_var": layer.b["running_var"],
            "epsilon": host_scalar(layer, "cudnn_epsilon", layer.eps),
            "momentum": host_scalar(layer, "cudnn_momentum", layer.momentum),
            "mean": layer._work.get("cudnn_mean", (c,), _FLOAT32, xp),
            "inv_var": layer._work.get("cudnn_inv_var", (c,), _FLOAT32, xp),
            "z": z,
        }
        if layer.residual is not None:  # BnAddRelu: the bitmask kept for backward
            arrays["residual"] = cudnn_graphs.in_dtype(
                layer._work, "cudnn_residual", layer.residual, io, xp
            )
            zeros = f"cudnn_zeros:{x.shape}:{io}"  # read only: one per shape, for every layer
            arrays["zeros"] = rt.work.get(zeros, x.shape, io, xp, zeroed=True)
            arrays["mask"] = layer._work.get("cudnn_mask", (bitmask_bytes(x.shape),), np.uint8, xp)
        layer.train = train
        rt.run(train_plan, arrays, xp)
        return z if io == x.dtype else z.astype(x.dtype)

    def backward(self, layer: Any, dy: Any) -> Any:
        rt, xp, work = cudnn_graphs.runtime(), array_module(dy), layer._work
        plan = self._plan(layer, dy, "backward")
        arrays = {
            "dz": cudnn_graphs.operand(work, "cudnn_dy", dy, plan.io, xp),
            "x": work.held("cudnn_x"),
            "scale": layer.p["gamma"],
            "mean": work.last("cudnn_mean"),
            "inv_var": work.last("cudnn_inv_var"),
            "dx": xp.empty(dy.shape, dtype=plan.io),
            "dscale": layer.g["gamma"],
            "dbias": layer.g["beta"],
        }
        if layer.residual is not None:
            arrays["mask"], arrays["dpre"] = work.last("cudnn_mask"), xp.empty(dy.shape, plan.io)
        else:  # DReluForkDBn recomputes BatchNorm's output
            arrays["bias"] = layer.p["beta"]
        rt.run(plan, arrays, xp)
        if layer.residual is not None:  # the shortcut's gradient: the add's, the relu's
            layer.residual_grad = arrays["dpre"].astype(dy.dtype, copy=False)
        layer.residual = None
        if not layer.input_grad:
            return None
        return arrays["dx"].astype(dy.dtype, copy=False)

    def _plan(self, layer: Any, x: Any, op: str) -> Plan:
        return self.cache.get(self.keys(layer, x.shape)[op])

    def _build(self, key: PlanKey) -> Plan:
        rt = cudnn_graphs.runtime()
        (x_shape, c_shape), io = key.shapes, cudnn_graphs.dtype_named(key.io)
        x_layout, c_layout, residual = nhwc(x_shape), nhwc(c_shape), key.op.startswith("bn_add")
        g, fp32 = rt.graph(io), rt.data_type(_FLOAT32)
        t = {"x": rt.tensor(g, "x", x_layout, io)}
        train = key.op.endswith("train")
        vectors = ("scale",) + (("bias", "in_mean", "in_var") if train else
                                ("mean", "inv_var") + (() if residual else ("bias",)))  # fmt: skip
        t.update({name: rt.tensor(g, name, c_layout, _FLOAT32) for name in vectors})
        if train:
            t.update({name: rt.scalar(g, name) for name in ("epsilon", "momentum")})
            outs = g.batchnorm(name="bn", **{kw: t[name] for kw, name in _TRAIN_INPUTS})
            t.update(zip(("y", "mean", "inv_var", "out_mean", "out_var"), outs, strict=True))
            pre = t["y"]
            if residual:
                t["residual"] = rt.tensor(g, "residual", x_layout, io)
                pre = g.add(a=pre, b=t["residual"], compute_data_type=fp32, name="add")
            t["z"] = g.relu(input=pre, compute_data_type=fp32, name="relu")
            rt.output(t["z"], x_layout, io)
            for name in ("mean", "inv_var", "out_mean", "out_var"):
                rt.output(t[name], c_layout, _FLOAT32)
            if residual:  # the bitmask (NOTE [fused BatchNorm backward])
                t["zeros"] = rt.tensor(g, "zeros", x_layout, io)
                t["mask"] = g.cmp_gt(input=t["z"], comparison=t["zeros"], name="relu_mask")
                rt.output(t["mask"], x_layout, cudnn_graphs.BITMASK)
            return rt.finish(g, t, io, by_value=("epsilon", "momentum"))
        t["dz"] = rt.tensor(g, "dz", x_layout, io)
        if residual:  # BnAddRelu: the loss where the bitmask is set
            t["mask"] = rt.tensor(g, "mask", x_layout, cudnn_graphs.BITMASK)
            t["dpre"] = g.scale(input=t["dz"], scale=t["mask"], compute_data_type=fp32,
                                name="relu_backward")  # fmt: skip
            rt.output(t["dpre"], x_layout, io)
        else:  # DReluForkDBn: over BatchNorm's output, recomputed
            y = g.batchnorm_inference(t["x"], t["mean"], t["inv_var"], t["scale"], t["bias"],
                                      name="bn_recomputed", compute_data_type=fp32)  # fmt: skip
            t["dpre"] = g.relu_backward(loss=t["dz"], input=y, compute_data_type=fp32,
                                        name="relu_backward")  # fmt: skip
            t["dpre"].set_data_type(rt.data_type(io))
        inputs = {"grad": t["dpre"], "input": t["x"], "scale": t["scale"], "mean": t["mean"],
                  "inv_variance": t["inv_var"]}  # fmt: skip
        outs = g.batchnorm_backward(name="bn_backward", **inputs)
        t.update(zip(("dx", "dscale", "dbias"), outs, strict=True))
        rt.output(t["dx"], x_layout, io)
        rt.output(t["dscale"], c_layout, _FLOAT32)
        rt.output(t["dbias"], c_layout, _FLOAT32)
        return rt.finish(g, t, io)


def bitmask_bytes(shape: tuple[int, ...]) -> int:
    """The bytes given to a BOOLEAN bitmask over shape: one per element, though cuDNN packs
    eight to a byte (its C++ sample allocates n / 8; its Python test a torch.bool tensor of n),
    so that no reading of the layout writes past the buffer before a GPU has shown which."""
    return int(np.prod(shape))


KERNELS: list[Any] = [CudnnBatchNormRelu(), CudnnBatchNorm()]
