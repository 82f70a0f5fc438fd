"""Torch tensors through mpi4py: the buffers MPI sees, the reduction ops, the scaling.

NOTE [tensor buffers]
A CPU tensor goes to MPI as a NumPy view of its memory (Tensor.numpy(): no copy). A GPU tensor
goes to MPI as itself (mpi4py reads DLPack / the CUDA array interface) when hpcdl's CUDA-awareness
decision (hpcdl.comm.cuda_aware, made once in hvd.init) says the MPI can read device memory, after
the current stream has finished writing it; otherwise it is copied to a pinned host buffer,
reduced there and copied back, as hpcdl's GradientReducer does. bfloat16 has no NumPy or MPI
type: its bits travel as uint16 and the reductions are MPI user ops that add, compare or
multiply them as bfloat16 (in float32), so Sum, Min, Max and Product work on every dtype.
float16 in host memory is reduced by a torch user op too: Open MPI's own float16 sum is about
13x slower (torch_op).

Scaling follows Horovod: integers are scaled in float64 and truncated back (so an integer
Average is the sum divided by the size, rounded toward zero), float16 on the CPU in float32.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from hpcdl.torch.ops import Average, Max, Min, Product, Sum

_user_ops: dict[tuple[str, int], Any] = {}


def mpi_op(op: int, dtype: Any, on_host: bool = True) -> Any:
    """The MPI reduction for Horovod's op on a tensor of dtype (Average and Sum: a sum) whose
    buffer is in host memory (on_host) or in device memory (a CUDA-aware MPI's)."""
    import torch  # noqa: PLC0415
    from mpi4py import MPI  # noqa: PLC0415

    if dtype == torch.bfloat16 or (dtype == torch.float16 and on_host):
        return torch_op(op, dtype)
    return {Average: MPI.SUM, Sum: MPI.SUM, Min: MPI.MIN, Max: MPI.MAX, Product: MPI.PROD}[op]


def torch_op(op: int, dtype: Any) -> Any:
    """An MPI user op that combines host buffers of a 16-bit float dtype with torch.

    bfloat16 has no MPI type (its bits travel as uint16); float16 has one, but Open MPI's own
    float16 sum took 106 ms for 12.5 M elements on 2 ranks where this op took 8 ms (and
    float32's sum 25 ms): fp16 compression would cost more than it saves. Each element is
    computed in float32 and rounded once, which for a sum is IEEE half addition."""
    import torch  # noqa: PLC0415
    from mpi4py import MPI  # noqa: PLC0415

    key = (str(dtype), op)
    if key not in _user_ops:
        combine = {
            Average: torch.add,
            Sum: torch.add,
            Min: torch.minimum,
            Max: torch.maximum,
            Product: torch.mul,
        }[op]

        def reduce(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
            if memoryview(inoutbuf).nbytes == 0:
                return
            a = torch.frombuffer(inbuf, dtype=dtype)
            b = torch.frombuffer(inoutbuf, dtype=dtype)
            if dtype == torch.float16:
                combine(a, b, out=b)
            else:  # bfloat16
                b.copy_(combine(a.float(), b.float()))

        _user_ops[key] = MPI.Op.Create(reduce, commute=True)
    return _user_ops[key]


def _numpy(tensor: Any) -> np.ndarray:
    """A NumPy view of a contiguous CPU tensor (bfloat16 and bool as same-sized integers)."""
    import torch  # noqa: PLC0415

    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    elif tensor.dtype == torch.bool:
        tensor = tensor.view(torch.uint8)
    return tensor.numpy().reshape(-1)


@contextmanager
def mpi_buffer(tensor: Any, aware: bool, copy_back: bool = True) -> Iterator[Any]:
    """What MPI reads and writes for a contiguous tensor (NOTE [tensor buffers]); a staged
    GPU tensor gets the host buffer's contents back on exit when copy_back."""
    import torch  # noqa: PLC0415

    if tensor.device.type == "cpu":
        yield _numpy(tensor)
        return
    if aware and tensor.dtype != torch.bfloat16:
        torch.cuda.current_stream(tensor.device).synchronize()
        yield tensor.reshape(-1)
        return
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor)
    yield _numpy(host)
    if copy_back:
        tensor.copy_(host)


def scale_(tensor: Any, factor: float) -> None:
    """tensor *= factor in place, as Horovod scales (module notes)."""
    import torch  # noqa: PLC0415

    if factor == 1.0:
        return
    if not tensor.dtype.is_floating_point:
        tensor.copy_((tensor.double() * factor).to(tensor.dtype))
    elif tensor.dtype == torch.float16 and tensor.device.type == "cpu":
        tensor.copy_((tensor.float() * factor).to(tensor.dtype))
    else:
        tensor.mul_(factor)


def allreduce_(comm: Any, tensor: Any, op: int, pre: float, post: float, aware: bool) -> None:
    """Reduce a contiguous tensor over comm in place: prescale, reduce, postscale (and / size
    for Average)."""
    scale_(tensor, pre)
    if tensor.numel():
        from mpi4py import MPI  # noqa: PLC0415

        with mpi_buffer(tensor, aware) as buf:
            on_host = tensor.device.type == "cpu" or not aware
            comm.Allreduce(MPI.IN_PLACE, buf, op=mpi_op(op, tensor.dtype, on_host))
    scale_(tensor, post / comm.Get_size() if op == Average else post)


def broadcast_(comm: Any, tensor: Any, root: int, aware: bool) -> None:
    if tensor.numel():
        with mpi_buffer(tensor, aware) as buf:
            comm.Bcast(buf, root=root)


def allgather(comm: Any, tensor: Any, rows: list[int], aware: bool) -> Any:
    """Concatenate every rank's tensor along dim 0 (rows[r]: rank r's first dimension)."""
    row = _row_size(tensor)
    out = tensor.new_empty((sum(rows), *tensor.shape[1:]))
    counts = [n * row for n in rows]
    with mpi_buffer(tensor, aware, copy_back=False) as send, mpi_buffer(out, aware) as recv:
        comm.Allgatherv(send, [recv, (counts, _offsets(counts))])
    return out


def alltoall(
    comm: Any, tensor: Any, send_rows: list[int], recv_rows: list[int], aware: bool
) -> Any:
    """Rank r gets send_rows[r] rows of this tensor; returns the rows received, by rank."""
    row = _row_size(tensor)
    out = tensor.new_empty((sum(recv_rows), *tensor.shape[1:]))
    send = [n * row for n in send_rows]
    recv = [n * row for n in recv_rows]
    with mpi_buffer(tensor, aware, copy_back=False) as sbuf, mpi_buffer(out, aware) as rbuf:
        comm.Alltoallv([sbuf, (send, _offsets(send))], [rbuf, (recv, _offsets(recv))])
    return out


def reducescatter(
    comm: Any, tensor: Any, rows: list[int], op: int, pre: float, post: float, aware: bool
) -> Any:
    """Reduce over comm and keep this rank's rows[rank] rows of the result (prescaled input,
    postscaled output, / size for Average)."""

    work = tensor.clone()
    scale_(work, pre)
    out = tensor.new_empty((rows[comm.Get_rank()], *tensor.shape[1:]))
    counts = [n * _row_size(tensor) for n in rows]
    on_host = tensor.device.type == "cpu" or not aware
    with mpi_buffer(work, aware, copy_back=False) as send, mpi_buffer(out, aware) as recv:
        comm.Reduce_scatter(send, recv, counts, op=mpi_op(op, tensor.dtype, on_host))
    scale_(out, post / comm.Get_size() if op == Average else post)
    return out


def split_rows(rows: int, size: int) -> list[int]:
    """Horovod's reducescatter split of dim 0: equal parts, the first ranks one row more."""
    return [rows // size + (1 if r < rows % size else 0) for r in range(size)]


def _row_size(tensor: Any) -> int:
    size = 1
    for n in tensor.shape[1:]:
        size *= n
    return size


def _offsets(counts: list[int]) -> list[int]:
    out, total = [], 0
    for n in counts:
        out.append(total)
        total += n
    return out
