"""Horovod's blocking collectives, differentiable as Horovod defines their gradients.

- allreduce: the gradient is the allreduce (same op and scale factors) of the output gradient;
- allgather: the output gradient averaged over ranks, then this rank's rows;
- broadcast: the output gradient averaged over ranks on the root, zero elsewhere;
- alltoall: the output gradient sent back with the received splits;
- reducescatter: the output gradient gathered (times the size for Sum, times the factors).
A backward pass runs collectives, so every rank must run it (as with any collective).
Compression (Compression.fp16) wraps allreduce and reducescatter as in Horovod.
"""

from __future__ import annotations

from typing import Any

import torch

from hpcdl.torch import collectives as c
from hpcdl.torch.compression import Compression
from hpcdl.torch.process import Average, Sum, size
from hpcdl.torch.process_sets import global_process_set


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, name, prescale, postscale, process_set):
        ctx.args = (op, prescale, postscale, process_set)
        return c.synchronize(
            c.allreduce_async(tensor, None, name, op, prescale, postscale, process_set)
        )

    @staticmethod
    def backward(ctx, grad):
        op, prescale, postscale, process_set = ctx.args
        out = allreduce(
            grad,
            op=op,
            prescale_factor=prescale,
            postscale_factor=postscale,
            process_set=process_set,
        )
        return out, None, None, None, None, None


def allreduce(
    tensor,
    average=None,
    name=None,
    compression=Compression.none,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=global_process_set,
):
    """Average (default) or reduce `tensor` over all ranks into a new tensor (differentiable)."""
    op = c.op_from(op, average)
    compressed, ctx = compression.compress(tensor)
    out = _Allreduce.apply(compressed, op, name, prescale_factor, postscale_factor, process_set)
    return compression.decompress(out, ctx)


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, name, prescale, postscale, process_set, *tensors):
        ctx.args = (op, prescale, postscale, process_set)
        return tuple(
            c.synchronize(
                c.grouped_allreduce_async(
                    list(tensors), None, name, op, prescale, postscale, process_set
                )
            )
        )

    @staticmethod
    def backward(ctx, *grads):
        op, prescale, postscale, process_set = ctx.args
        outs = grouped_allreduce(
            list(grads),
            op=op,
            prescale_factor=prescale,
            postscale_factor=postscale,
            process_set=process_set,
        )
        return (None, None, None, None, None, *outs)


def grouped_allreduce(
    tensors,
    average=None,
    name=None,
    compression=Compression.none,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=global_process_set,
):
    """allreduce of a list of tensors as one collective; a list of new tensors."""
    op = c.op_from(op, average)
    pairs = [compression.compress(t) for t in tensors]
    outs = _GroupedAllreduce.apply(
        op, name, prescale_factor, postscale_factor, process_set, *[t for t, _ in pairs]
    )
    return [compression.decompress(t, ctx) for t, (_, ctx) in zip(outs, pairs)]


def _own_rows(grads: list[Any], dims: list[int], process_set: Any) -> list[Any]:
    """This rank's rows of each averaged gradient of a gather (first dimensions by rank)."""
    reduced = grouped_allreduce(grads, op=Average, process_set=process_set)
    counts = grouped_allgather([torch.tensor([d], dtype=torch.int64) for d in dims])
    rank = c.process.rank()
    outs = []
    for g, n, d in zip(reduced, counts, dims):
        start = int(n[:rank].sum()) if rank else 0
        outs.append(g.narrow(0, start, d))
    return outs


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.dim, ctx.process_set = tensor.shape[0] if tensor.dim() else 0, process_set
        return c.synchronize(c.allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        return _own_rows([grad], [ctx.dim], ctx.process_set)[0], None, None


def allgather(tensor, name=None, process_set=global_process_set):
    """Every rank's tensor concatenated along dim 0 (sizes may differ there; differentiable)."""
    return _Allgather.apply(tensor, name, process_set)


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.dims, ctx.process_set = [t.shape[0] for t in tensors], process_set
        return tuple(c.synchronize(c.grouped_allgather_async(list(tensors), name, process_set)))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *_own_rows(list(grads), ctx.dims, ctx.process_set))


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """Every rank's copy of each of `tensors` concatenated along dim 0 (differentiable).

    Args:
        tensors: the tensors to gather, one request; dim 0 may differ by rank.
        name: a name for the request; ranks pair requests by it (default: one by call order).
        process_set: the global process set only (others raise NotBuilt).

    Returns:
        A list of the gathered tensors; their gradient is this rank's rows of the averaged
        gradients."""
    return list(_GroupedAllgather.apply(name, process_set, *tensors))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root, ctx.process_set = root_rank, process_set
        return c.synchronize(c.broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        reduced = allreduce(grad, op=Average, process_set=ctx.process_set)
        if c.process.rank() != ctx.root:
            reduced = reduced * 0
        return reduced, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """Root rank's tensor, as a new tensor on every rank (differentiable)."""
    return _Broadcast.apply(tensor, root_rank, name, process_set)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        out, received = c.synchronize(c.alltoall_async(tensor, splits, name, process_set))
        ctx.received, ctx.process_set = received, process_set
        if splits is None:
            return out
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, *_):
        back, _ = alltoall(grad.contiguous(), splits=ctx.received, process_set=ctx.process_set)
        return back, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Rows of `tensor` to each rank (splits[r] to rank r; equal parts when None). Returns the
    rows received, and with splits also the received splits (int32)."""
    return _Alltoall.apply(tensor, splits, name, process_set)


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, process_set, prescale, postscale):
        ctx.args = (op, process_set, prescale, postscale)
        return c.synchronize(
            c.reducescatter_async(tensor, name, op, process_set, prescale, postscale)
        )

    @staticmethod
    def backward(ctx, grad):
        op, process_set, prescale, postscale = ctx.args
        factor = (size() if op == Sum else 1) * prescale * postscale
        return allgather(grad * factor, process_set=process_set), None, None, None, None, None


def reducescatter(
    tensor,
    name=None,
    compression=Compression.none,
    op=Average,
    process_set=global_process_set,
    prescale_factor=1.0,
    postscale_factor=1.0,
):
    """Reduce over all ranks and keep this rank's part of dim 0 (differentiable)."""
    compressed, ctx = compression.compress(tensor)
    out = _Reducescatter.apply(compressed, name, op, process_set, prescale_factor, postscale_factor)
    return compression.decompress(out, ctx)


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, process_set, prescale, postscale, *tensors):
        ctx.args = (op, process_set, prescale, postscale)
        handle = c.grouped_reducescatter_async(
            list(tensors), name, op, process_set, prescale, postscale
        )
        return tuple(c.synchronize(handle))

    @staticmethod
    def backward(ctx, *grads):
        op, process_set, prescale, postscale = ctx.args
        factor = (size() if op == Sum else 1) * prescale * postscale
        gathered = grouped_allgather([g * factor for g in grads], process_set=process_set)
        return (None, None, None, None, None, *gathered)


def grouped_reducescatter(
    tensors,
    name=None,
    compression=Compression.none,
    op=Average,
    process_set=global_process_set,
    prescale_factor=1.0,
    postscale_factor=1.0,
):
    """Reduce each of `tensors` over all ranks and keep this rank's rows (differentiable).

    Args:
        tensors: the tensors to reduce, one request; the same shapes on every rank.
        name: a name for the request; ranks pair requests by it (default: one by call order).
        compression: Compression.none or Compression.fp16 (sent as float16, returned in the
            input's dtype).
        op: Average (the default) or Sum.
        process_set: the global process set only (others raise NotBuilt).
        prescale_factor: multiplies each input before the reduction.
        postscale_factor: multiplies each result after it.

    Returns:
        A list of this rank's parts of dim 0 (the first ranks get one row more when it does not
        divide); their gradient is the gathered gradient, scaled as the reduction was."""
    pairs = [compression.compress(t) for t in tensors]
    outs = _GroupedReducescatter.apply(
        name, op, process_set, prescale_factor, postscale_factor, *[t for t, _ in pairs]
    )
    return [compression.decompress(t, ctx) for t, (_, ctx) in zip(outs, pairs)]


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set):
    """A sparse tensor's allreduce as two allgathers (indices, values); returns a callable
    that waits and gives the reduced sparse tensor (Average divides the values by the size)."""
    indices = c.allgather_async(
        tensor._indices().transpose(0, 1).contiguous(),
        name=f"{name}.indices",
        process_set=process_set,
    )
    values = c.allgather_async(tensor._values(), name=f"{name}.values", process_set=process_set)

    def wait():
        vals = c.synchronize(values)
        idx = c.synchronize(indices)
        if op == Average:
            vals = vals / size()
        return torch.sparse_coo_tensor(
            idx.transpose(0, 1), vals, tensor.size(), check_invariants=True
        )

    return wait
