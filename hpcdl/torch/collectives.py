"""Horovod's asynchronous collectives, in-place forms, poll, synchronize, barrier and join.

Each `*_async` call describes its tensors (hpcdl.torch.engine.Descriptor), queues them under a
name and returns a handle at once; `synchronize(handle)` waits for the result (NOTE
[negotiation rounds] in engine.py). The input tensor is kept until then, as Horovod keeps it.
The autograd-aware blocking forms (allreduce, allgather, ...) are in hpcdl.torch.autograd.
Arguments, defaults and results are Horovod 0.28.1's.
"""

from __future__ import annotations

import warnings
from typing import Any

from hpcdl.torch import process
from hpcdl.torch.engine import Descriptor
from hpcdl.torch.process import Adasum, Average, Sum
from hpcdl.torch.process_sets import check_process_set, global_process_set
from hpcdl.torch.unbuilt import not_built

_SUPPORTED = (
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "bool",
)


def _engine() -> Any:
    return process.state().engine


def op_from(op: int | None, average: bool | None) -> int:
    """Horovod's op from the deprecated `average` flag and `op` (op wins; not both)."""
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if average is not None:
        warnings.warn(
            "Parameter `average` has been replaced with `op` and will be removed in v1.0",
            DeprecationWarning,
            stacklevel=3,
        )
        return Average if average else Sum
    return Average if op is None else op


def _problem(tensors: list[Any]) -> str | None:
    for t in tensors:
        dtype = str(t.dtype).replace("torch.", "")
        if dtype not in _SUPPORTED:
            return f"tensor type {dtype} is not supported"
        if not t.is_contiguous():
            return "the tensor is not contiguous (call .contiguous() first)"
    if len({t.device.type for t in tensors}) > 1:
        return "the group mixes CPU and GPU tensors"
    return None


def describe(kind: str, name: str | None, tensors: list[Any], **fields: Any) -> Descriptor:
    """The descriptor of a collective on these tensors; this rank's problems go in `problem`."""
    engine = _engine()
    problem = fields.pop("problem", None) or _problem(tensors)
    if fields.get("op") == Adasum:
        problem, fields["unbuilt"] = str(not_built("Adasum (op=hvd.Adasum)")), True
    specs = tuple((tuple(t.shape), str(t.dtype), t.device.type) for t in tensors)
    return Descriptor(engine.name_for(kind, name), kind, specs, problem=problem, **fields)


def _submit(
    desc: Descriptor, tensors: list[Any], in_place: bool, grouped: bool, extra: Any = None
) -> int:
    return _engine().submit(desc, list(tensors), in_place, grouped, extra)


def _dense(tensors: Any) -> list[Any]:
    """Inputs of an out-of-place collective: a contiguous copy where a tensor is not (an
    expanded gradient, a transposed view); in-place forms need contiguous tensors."""
    return [t.contiguous() for t in tensors]


def _allreduce_async(tensors, in_place, grouped, name, op, prescale, postscale, process_set):
    check_process_set(process_set)
    desc = describe("allreduce", name, tensors, op=op, scale=(float(prescale), float(postscale)))
    return _submit(desc, tensors, in_place, grouped)


def allreduce_async(
    tensor,
    average=None,
    name=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=global_process_set,
):
    """Average or sum `tensor` over all ranks into a new tensor; returns a handle."""
    op = op_from(op, average)
    return _allreduce_async(
        _dense([tensor]), False, False, name, op, prescale_factor, postscale_factor, process_set
    )


def allreduce_async_(
    tensor,
    average=None,
    name=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=global_process_set,
):
    """As allreduce_async, in place."""
    op = op_from(op, average)
    return _allreduce_async(
        [tensor], True, False, name, op, prescale_factor, postscale_factor, process_set
    )


def allreduce_(
    tensor,
    average=None,
    name=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=global_process_set,
):
    """Average or sum `tensor` over all ranks in place; returns it."""
    return synchronize(
        allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set)
    )


def grouped_allreduce_async(
    tensors,
    average=None,
    name=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=global_process_set,
):
    """Average or sum each of `tensors` over all ranks into new tensors, asynchronously.

    Args:
        tensors: the tensors to reduce, one request (Horovod's grouped operation: negotiated and
            reduced together, so no rank starts before every rank has submitted all of them).
        average: deprecated, Horovod's; use op.
        name: a name for the request; ranks pair requests by it (default: one by call order).
        op: Average (the default), Sum, Min, Max or Product; Adasum raises NotBuilt.
        prescale_factor: multiplies each input before the reduction.
        postscale_factor: multiplies each result after it.
        process_set: the global process set only (others raise NotBuilt).

    Returns:
        A handle for poll() and synchronize(); synchronize gives the list of reduced tensors."""
    op = op_from(op, average)
    return _allreduce_async(
        _dense(tensors), False, True, name, op, prescale_factor, postscale_factor, process_set
    )


def grouped_allreduce_async_(
    tensors,
    average=None,
    name=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=global_process_set,
):
    """As grouped_allreduce_async, in place: each tensor holds its result.

    Args:
        The same as grouped_allreduce_async's.

    Returns:
        A handle for poll() and synchronize(); synchronize gives `tensors`, reduced."""
    op = op_from(op, average)
    return _allreduce_async(
        list(tensors), True, True, name, op, prescale_factor, postscale_factor, process_set
    )


def grouped_allreduce_(
    tensors,
    average=None,
    name=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=global_process_set,
):
    """Average or sum each of `tensors` over all ranks in place; blocks until done.

    Args:
        The same as grouped_allreduce_async's.

    Returns:
        The list `tensors`, each holding its reduced value."""
    return synchronize(
        grouped_allreduce_async_(
            tensors, average, name, op, prescale_factor, postscale_factor, process_set
        )
    )


def allgather_async(tensor, name=None, process_set=global_process_set):
    """Concatenate every rank's tensor along dim 0 (which may differ by rank); a handle."""
    return grouped_allgather_async([tensor], name, process_set, _grouped=False)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set, _grouped=True):
    """Concatenate every rank's copy of each of `tensors` along dim 0, asynchronously.

    Args:
        tensors: the tensors to gather, one request; dim 0 may differ by rank, the other
            dimensions and the dtypes must agree.
        name: a name for the request; ranks pair requests by it (default: one by call order).
        process_set: the global process set only (others raise NotBuilt).

    Returns:
        A handle for poll() and synchronize(); synchronize gives the list of gathered tensors."""
    check_process_set(process_set)
    tensors = _dense(tensors)
    problem = (
        "allgather needs at least one dimension" if any(t.dim() == 0 for t in tensors) else None
    )
    desc = describe("allgather", name, list(tensors), problem=problem)
    return _submit(desc, tensors, False, _grouped)


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    """Root rank's tensor on every rank, in a new tensor; a handle."""
    check_process_set(process_set)
    (tensor,) = _dense([tensor])
    desc = describe("broadcast", name, [tensor], root=int(root_rank))
    return _submit(desc, [tensor], False, False)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    """As broadcast_async, in place."""
    check_process_set(process_set)
    desc = describe("broadcast", name, [tensor], root=int(root_rank))
    return _submit(desc, [tensor], True, False)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """Overwrite `tensor` with root rank's; returns it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    """Send splits[r] rows of `tensor` to rank r (equal parts when None); a handle whose result
    is (received rows, received splits)."""
    import torch  # noqa: PLC0415

    check_process_set(process_set)
    (tensor,) = _dense([tensor])
    rows, problem = _send_rows(tensor, splits, process.size())
    desc = describe("alltoall", name, [tensor], splits=rows, problem=problem)
    device = splits.device if isinstance(splits, torch.Tensor) else "cpu"
    splits_out = {"recv_splits": lambda recv: torch.tensor(recv, dtype=torch.int32, device=device)}
    return _submit(desc, [tensor], False, False, splits_out)


def _send_rows(tensor: Any, splits: Any, size: int) -> tuple[tuple[int, ...], str | None]:
    import torch  # noqa: PLC0415

    first = tensor.shape[0] if tensor.dim() else 0
    if tensor.dim() == 0:
        return (0,) * size, "alltoall needs at least one dimension"
    if splits is None:
        if first % size:
            return (0,) * size, (
                f"the first dimension ({first}) is not a multiple of the number "
                f"of ranks ({size}); give splits"
            )
        return (first // size,) * size, None
    if isinstance(splits, torch.Tensor):
        if splits.dtype != torch.int32:
            return (
                0,
            ) * size, f"splits must hold int32, not {str(splits.dtype).replace('torch.', '')}"
        splits = splits.tolist()
    rows = tuple(int(n) for n in splits)
    if len(rows) != size or min(rows) < 0:
        return (0,) * size, f"splits must be {size} non-negative counts, got {list(rows)}"
    if sum(rows) > first:
        return (
            0,
        ) * size, f"the splits add up to {sum(rows)}, more than the first dimension ({first})"
    return rows, None


def reducescatter_async(
    tensor,
    name=None,
    op=Average,
    process_set=global_process_set,
    prescale_factor=1.0,
    postscale_factor=1.0,
):
    """Reduce over all ranks and keep this rank's part of dim 0 (the first ranks get one row
    more when it does not divide); a handle."""
    return grouped_reducescatter_async(
        [tensor], name, op, process_set, prescale_factor, postscale_factor, _grouped=False
    )


def grouped_reducescatter_async(
    tensors,
    name=None,
    op=Average,
    process_set=global_process_set,
    prescale_factor=1.0,
    postscale_factor=1.0,
    _grouped=True,
):
    """Reduce each of `tensors` over all ranks and keep this rank's rows, asynchronously.

    Args:
        tensors: the tensors to reduce, one request; the same shapes on every rank, at least one
            dimension. Dim 0 is split over the ranks; the first ranks get one row more when it
            does not divide.
        name: a name for the request; ranks pair requests by it (default: one by call order).
        op: Average (the default) or Sum.
        process_set: the global process set only (others raise NotBuilt).
        prescale_factor: multiplies each input before the reduction.
        postscale_factor: multiplies each result after it.

    Returns:
        A handle for poll() and synchronize(); synchronize gives this rank's parts, a list."""
    check_process_set(process_set)
    tensors = _dense(tensors)
    problem = None
    if any(t.dim() == 0 for t in tensors):
        problem = "reducescatter needs at least one dimension (got a scalar)"
    elif op not in (Average, Sum, Adasum):  # Adasum: NotBuilt (describe)
        problem = "reducescatter supports op=Average and op=Sum"
    desc = describe(
        "reducescatter",
        name,
        tensors,
        op=op,
        problem=problem,
        scale=(float(prescale_factor), float(postscale_factor)),
    )
    return _submit(desc, tensors, False, _grouped)


def poll(handle: int) -> bool:
    """True when the collective has finished; synchronize() then returns at once."""
    return _engine().poll(handle)


def synchronize(handle: Any) -> Any:
    """Wait for an async collective and return its result (a sparse allreduce's callable
    handle is called)."""
    if callable(handle):
        return handle()
    return _engine().synchronize(handle)


def barrier(process_set=global_process_set) -> None:
    """Every rank waits here until all have reached it (the collectives queued before it run)."""
    check_process_set(process_set)
    _engine().barrier()


def join(device: int = -1) -> int:
    """Stand in with zeros for this rank's allreduces until every rank has joined; returns the
    rank that joined last (the same on every rank)."""
    where = "cpu" if device is None or int(device) < 0 else f"cuda:{int(device)}"
    return _engine().join(where)
