"""Fast kernels for Conv2d (NOTE [fast kernels] in hpcdl/nn/kernels/__init__.py).

CudnnConv: forward, data gradient and weight gradient as three cuDNN frontend graphs in NHWC
(NOTE [cuDNN graphs] in hpcdl/nn/kernels/cudnn_graphs.py), on CuPy arrays with --gpu-kernels.
It applies to a layer and input shape once all three plans are built (the data gradient's
only where the layer computes one); in bf16/fp16 an op cuDNN has no plan for runs its float32
plan alone (PlanCache); a shape refused in float32 too stays with Conv2d's im2col path.
y and dx come back in the dtype of x and dy: float32 (emulated) or the format's (real half
arrays, hpcdl.nn.dtypes), so real arrays never pass through float32 between layers. The
weight gradient comes out in float32, or with HPCDL_HALF_WGRAD in the format, as PyTorch's
autocast computes it (NOTE [half weight gradients] in hpcdl/nn/kernels/__init__.py).
A float64 model's three graphs are DOUBLE, its weight gradient summed in float64; a shape
cuDNN has no DOUBLE plan for stays with Conv2d's own float64 code, never float32.
Where none applies, Conv2d runs its own im2col / Winograd code.
"""

from __future__ import annotations

from typing import Any

from hpcdl.backend import array_module
from hpcdl.nn import kernels
from hpcdl.nn.dtypes import matmul
from hpcdl.nn.kernels import cudnn_graphs
from hpcdl.nn.kernels.cudnn_graphs import Plan, PlanCache, PlanKey, krsc, nhwc


class CudnnConv:
    """Conv2d through cuDNN graphs; plans cached per shape (one cache per process)."""

    name = "cudnn"

    def __init__(self) -> None:
        self.cache = PlanCache(self._build)

    def keys(self, layer: Any, x_shape: tuple[int, ...]) -> dict[str, PlanKey]:
        """The plans a forward and backward of layer on x_shape need, by operation."""
        n, h, w, _ = x_shape
        ho, wo = layer.output_hw(h, w)
        shapes = (tuple(x_shape), tuple(layer.p["W"].shape), (n, ho, wo, layer.c_out))
        io = cudnn_graphs.io_dtype(layer.precision, layer.p["W"].dtype).name
        ops = ["conv_fprop", "conv_wgrad"] + (["conv_dgrad"] if layer.input_grad else [])
        pads, strides = (layer.ph, layer.pw), (layer.sh, layer.sw)
        keys = {op: PlanKey(op, shapes, io, pads, strides) for op in ops}
        if kernels.half_wgrad() and io in ("bfloat16", "float16"):  # NOTE [half weight gradients]
            keys["conv_wgrad"] = PlanKey("conv_wgrad_half", shapes, io, pads, strides)
        return keys

    def applies(self, layer: Any, x: Any) -> bool:
        if cudnn_graphs.runtime_for(x) is None or not x.flags.c_contiguous:
            return False
        return all(self.cache.get(key) is not None for key in self.keys(layer, x.shape).values())

    def forward(self, layer: Any, x: Any, train: bool) -> Any:
        rt, xp = cudnn_graphs.runtime(), array_module(x)
        keys = self.keys(layer, x.shape)
        fprop = self.cache.get(keys["conv_fprop"])
        io = cudnn_graphs.io_dtype(layer.precision, layer.p["W"].dtype)  # fprop's may be float32
        xs = cudnn_graphs.kept(layer._buffers, "cudnn_x", x, io, xp)  # for the weight gradient
        wk = layer._buffers.get("cudnn_w_krsc", _krsc_shape(layer), io, xp)
        wk[...] = layer.p["W"].transpose(3, 0, 1, 2)  # (kh, kw, C_in, C_out) -> KRSC
        y = xp.empty(keys["conv_fprop"].shapes[2], dtype=fprop.io)
        inputs = {"x": xs, "w": wk}
        rt.run(fprop, {**self._as(layer, inputs, fprop.io, xp), "y": y}, xp)
        y = y if y.dtype == x.dtype else y.astype(x.dtype)  # x's: float32 or the format's
        if layer.has_bias:
            y += layer.p["b"]
        layer.x_shape = x.shape
        return y

    def backward(self, layer: Any, dy: Any) -> Any:
        rt, xp = cudnn_graphs.runtime(), array_module(dy)
        keys = self.keys(layer, layer.x_shape)
        xs, wk = layer._buffers.held("cudnn_x"), layer._workspace("cudnn_w_krsc")
        dys = cudnn_graphs.operand(layer._buffers, "cudnn_dy", dy, xs.dtype, xp)
        if layer.has_bias:  # a GEMV with ones, as the reference
            rows = dy.reshape(-1, dy.shape[-1])
            ones = layer._workspace("ones", (rows.shape[0],), dy.dtype, xp, fill=1)
            matmul(ones, rows, out=layer.g["b"])
        wgrad = self.cache.get(keys["conv_wgrad"])
        dwk = layer._buffers.get("cudnn_dw_krsc", _krsc_shape(layer), wgrad.out, xp)
        rt.run(wgrad, {**self._as(layer, {"x": xs, "dy": dys}, wgrad.io, xp), "dw": dwk}, xp)
        layer.g["W"][...] = dwk.transpose(1, 2, 3, 0)  # KRSC -> (kh, kw, C_in, C_out), widened
        if not layer.input_grad:
            return None
        dgrad = self.cache.get(keys["conv_dgrad"])
        dx = xp.empty(layer.x_shape, dtype=dgrad.io)
        rt.run(dgrad, {**self._as(layer, {"dy": dys, "w": wk}, dgrad.io, xp), "dx": dx}, xp)
        return dx if dx.dtype == dy.dtype else dx.astype(dy.dtype)

    @staticmethod
    def _as(layer: Any, arrays: dict[str, Any], dtype: Any, xp: Any) -> dict[str, Any]:
        """arrays in a plan's I/O dtype (copies where it fell back to float32)."""
        work = layer._buffers
        return {
            n: cudnn_graphs.in_dtype(work, f"cudnn_{n}", a, dtype, xp) for n, a in arrays.items()
        }

    def _build(self, key: PlanKey) -> Plan:
        rt = cudnn_graphs.runtime()
        x_shape, w_shape, y_shape = key.shapes
        io = cudnn_graphs.dtype_named(key.io)
        g = rt.graph(io)
        conv = {"padding": list(key.padding), "stride": list(key.stride), "dilation": [1, 1]}
        x, w, y = nhwc(x_shape), krsc(w_shape), nhwc(y_shape)  # (dims, strides) of each

        def tensors(*named: tuple[str, Any]) -> dict[str, Any]:  # the graph's inputs, in io
            return {name: rt.tensor(g, name, dims, io) for name, dims in named}

        out = io  # the output's dtype
        if key.op == "conv_fprop":
            t = tensors(("x", x), ("w", w))
            t["y"] = g.conv_fprop(image=t["x"], weight=t["w"], **conv)
            rt.output(t["y"], y, out)
        elif key.op == "conv_dgrad":
            t = tensors(("dy", y), ("w", w))
            t["dx"] = g.conv_dgrad(loss=t["dy"], filter=t["w"], **conv)
            rt.output(t["dx"], x, out)
        else:  # summed in float32/64 and kept so; conv_wgrad_half: written in the format
            t = tensors(("x", x), ("dy", y))
            t["dw"] = g.conv_wgrad(image=t["x"], loss=t["dy"], **conv)
            out = io if key.op == "conv_wgrad_half" else cudnn_graphs.sums_dtype(io)
            rt.output(t["dw"], w, out)
        plan = rt.finish(g, t, io, tune=True)
        plan.out = out
        return plan


def _krsc_shape(layer: Any) -> tuple[int, int, int, int]:
    kh, kw, c_in, c_out = layer.p["W"].shape
    return (c_out, kh, kw, c_in)


KERNELS: list[Any] = [CudnnConv()]
