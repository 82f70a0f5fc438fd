"""A stand-in for NVIDIA's cuDNN frontend module (`cudnn`) that executes its graphs in NumPy.

It reads every tensor through the dim and stride the kernel declared (cuDNN's NCHW-ordered
names over hpcdl's NHWC / KRSC memory), so a wrong layout gives wrong numbers, and it records
what was built. Used with hpcdl.nn.kernels.cudnn_graphs.Runtime(pointer=identity) on NumPy
arrays: the "pointers" are the arrays themselves.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np


class cudnnGraphNotSupportedError(Exception):  # noqa: N801 - the frontend's own name
    pass


data_type = SimpleNamespace(FLOAT="FLOAT", HALF="HALF", BFLOAT16="BFLOAT16")
heur_mode = SimpleNamespace(A="A", FALLBACK="FALLBACK")


class Tensor:
    def __init__(self, name, dim=None, stride=None, data_type=None, op=None, inputs=None):
        self.name, self.dim, self.stride, self.data_type = name, dim, stride, data_type
        self.op, self.inputs, self.is_output = op, inputs or {}, False

    def set_output(self, flag):
        self.is_output = flag
        return self

    def set_dim(self, dim):
        self.dim = list(dim)
        return self

    def set_stride(self, stride):
        self.stride = list(stride)
        return self

    def set_data_type(self, dt):
        self.data_type = dt
        return self


class Module:
    """The module: pygraph, create_handle, data_type, heur_mode; refuse(op, x_dim) -> bool
    makes building such a graph fail as cuDNN does for a shape it has no engine for."""

    cudnnGraphNotSupportedError = cudnnGraphNotSupportedError
    data_type, heur_mode = data_type, heur_mode

    def __init__(self, refuse=lambda op, dims: False):
        self.refuse, self.graphs, self.executions = refuse, [], 0

    def create_handle(self):
        return "handle"

    def pygraph(self, **kwargs):
        graph = Graph(self, kwargs)
        self.graphs.append(graph)
        return graph

    def backend_version(self):
        return 91900


class Graph:
    def __init__(self, module, options):
        self.module, self.options, self.ops, self.built = module, options, [], []

    def tensor(self, name, dim, stride, data_type, is_pass_by_value=False):
        return Tensor(name, list(dim), list(stride), data_type)

    def _op(self, op, outputs=1, **inputs):
        outs = [Tensor(f"{op}:{i}", op=op, inputs=inputs) for i in range(outputs)]
        self.ops.append(outs)
        return outs[0] if outputs == 1 else outs

    def batchnorm(self, name, input, scale, bias, in_running_mean, in_running_var, **kw):  # noqa: A002
        return self._op(
            "batchnorm", 5, x=input, scale=scale, bias=bias, rm=in_running_mean,
            rv=in_running_var, eps=kw["epsilon"], momentum=kw["momentum"],
        )  # fmt: skip

    def batchnorm_backward(self, name, grad, input, scale, mean, inv_variance):  # noqa: A002
        return self._op(
            "batchnorm_backward", 3, dy=grad, x=input, scale=scale, mean=mean, inv_var=inv_variance
        )

    def conv_fprop(self, image, weight, padding, stride, dilation):
        return self._op("conv_fprop", x=image, w=weight, padding=padding, stride=stride)

    def conv_dgrad(self, loss, filter, padding, stride, dilation):  # noqa: A002
        return self._op("conv_dgrad", dy=loss, w=filter, padding=padding, stride=stride)

    def conv_wgrad(self, image, loss, padding, stride, dilation):
        return self._op("conv_wgrad", x=image, dy=loss, padding=padding, stride=stride)

    def validate(self):
        self.built.append("validate")
        for outs in self.ops:
            first = next(t for t in outs[0].inputs.values() if isinstance(t, Tensor))
            if self.module.refuse(outs[0].op, first.dim):
                raise cudnnGraphNotSupportedError(f"no engine for {outs[0].op} {first.dim}")

    def build_operation_graph(self):
        self.built.append("operation_graph")

    def create_execution_plans(self, modes):
        self.built.append(("plans", tuple(modes)))

    def check_support(self):
        self.built.append("support")

    def build_plans(self):
        self.built.append("build")

    def get_workspace_size(self):
        return 64

    def execute(self, pack, workspace, handle):
        self.module.executions += 1
        for outs in self.ops:
            args = {
                k: (_view(pack[t], t) if isinstance(t, Tensor) else t)
                for k, t in outs[0].inputs.items()
            }
            results = globals()[f"_{outs[0].op}"](args, outs[0].dim)
            for out, result in zip(outs, results if len(outs) > 1 else [results], strict=True):
                target = _view(pack[out], out)
                target[...] = result.astype(target.dtype)


def _view(array, tensor):
    """The array as cuDNN reads it: the declared dim (NCHW order) over the declared strides."""
    flat = array.reshape(-1)
    strides = [s * flat.itemsize for s in tensor.stride]
    return np.lib.stride_tricks.as_strided(flat, shape=tensor.dim, strides=strides)


def _padded(x, padding):
    ph, pw = padding
    return np.pad(x.astype(np.float64), ((0, 0), (0, 0), (ph, ph), (pw, pw)))


def _conv_fprop(a, y_dim):
    x, w = _padded(a["x"], a["padding"]), a["w"].astype(np.float64)
    (sh, sw), (_, _, ho, wo) = a["stride"], y_dim
    y = np.zeros(y_dim)
    for r in range(w.shape[2]):
        for s in range(w.shape[3]):
            patch = x[:, :, r : r + sh * ho : sh, s : s + sw * wo : sw]
            y += np.einsum("nchw,kc->nkhw", patch, w[:, :, r, s])
    return y


def _conv_dgrad(a, x_dim):
    dy, w = a["dy"].astype(np.float64), a["w"].astype(np.float64)
    (ph, pw), (sh, sw) = a["padding"], a["stride"]
    n, c, h, wd = x_dim
    dx = np.zeros((n, c, h + 2 * ph + sh, wd + 2 * pw + sw))
    ho, wo = dy.shape[2:]
    for r in range(w.shape[2]):
        for s in range(w.shape[3]):
            dx[:, :, r : r + sh * ho : sh, s : s + sw * wo : sw] += np.einsum(
                "nkhw,kc->nchw", dy, w[:, :, r, s]
            )
    return dx[:, :, ph : ph + h, pw : pw + wd]


def _conv_wgrad(a, w_dim):
    x, dy = _padded(a["x"], a["padding"]), a["dy"].astype(np.float64)
    (sh, sw), (ho, wo) = a["stride"], dy.shape[2:]
    dw = np.zeros(w_dim)
    for r in range(w_dim[2]):
        for s in range(w_dim[3]):
            patch = x[:, :, r : r + sh * ho : sh, s : s + sw * wo : sw]
            dw[:, :, r, s] = np.einsum("nchw,nkhw->kc", patch, dy)
    return dw


def _batchnorm(a, _):
    """(y, mean, inv_var, running mean, running var) over (N, C, H, W), PyTorch's rule: the
    running variance takes the unbiased batch variance."""
    x, eps, mom = (
        a["x"].astype(np.float64),
        float(a["eps"][0, 0, 0, 0]),
        float(a["momentum"][0, 0, 0, 0]),
    )
    m = x.size // x.shape[1]
    mean, var = x.mean(axis=(0, 2, 3), keepdims=True), x.var(axis=(0, 2, 3), keepdims=True)
    inv = 1.0 / np.sqrt(var + eps)
    y = (x - mean) * inv * a["scale"] + a["bias"]
    rm = (1 - mom) * a["rm"] + mom * mean
    rv = (1 - mom) * a["rv"] + mom * var * m / (m - 1)
    return y, mean, inv, rm, rv


def _batchnorm_backward(a, _):
    """(dx, dscale, dbias) of the training forward."""
    dy, x = a["dy"].astype(np.float64), a["x"].astype(np.float64)
    xhat = (x - a["mean"]) * a["inv_var"]
    dbias = dy.sum(axis=(0, 2, 3), keepdims=True)
    dscale = (dy * xhat).sum(axis=(0, 2, 3), keepdims=True)
    m = x.size // x.shape[1]
    dx = a["scale"] * a["inv_var"] * (dy - dbias / m - xhat * dscale / m)
    return dx, dscale, dbias
