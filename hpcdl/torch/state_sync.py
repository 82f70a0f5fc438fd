"""Start every rank from rank 0's model and optimizer: Horovod's broadcast_parameters,
broadcast_optimizer_state, broadcast_object and allgather_object.

Tensors go through the named broadcasts (hpcdl.torch.collectives), all submitted before any is
waited for. Objects are pickled (the standard library's pickle, not cloudpickle as in Horovod:
lambdas and local classes do not travel) and travel as uint8 tensors with their length first.
broadcast_optimizer_state follows Horovod: a fresh optimizer has no state yet, so it takes one
step with zero gradients first (the base class's step, without DistributedOptimizer's
allreduce), then broadcasts every tensor of the state, and the options (lr, momentum, ...) and
scalar state as one object, cast back to each rank's own types.
"""

from __future__ import annotations

import collections
import io
import pickle
from collections.abc import Iterable
from typing import Any

import torch

from hpcdl.torch import collectives as c
from hpcdl.torch import process
from hpcdl.torch.autograd import allgather
from hpcdl.torch.optimizer import is_distributed
from hpcdl.torch.process_sets import global_process_set


def broadcast_parameters(params: Any, root_rank: int) -> None:
    """Overwrite params (a state_dict, named_parameters() or parameters()) with root's, in place."""
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, list):
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"invalid params of type: {type(params)}")
    handles = [c.broadcast_async_(p, root_rank, name) for name, p in items]
    for handle in handles:
        c.synchronize(handle)


def broadcast_object(
    obj: Any, root_rank: int = 0, name: str | None = None, process_set=global_process_set
) -> Any:
    """Root rank's object on every rank (pickled). Without a name the broadcasts are named in
    call order, not after the object's type (Horovod's), which differs when the other ranks
    pass None."""
    names = (None, None) if name is None else (f"{name}.sz", f"{name}.t")
    if process.rank() == root_rank:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        length = torch.tensor([data.numel()], dtype=torch.int64)
    else:
        length = torch.zeros(1, dtype=torch.int64)
    c.broadcast_(length, root_rank, names[0], process_set)
    if process.rank() != root_rank:
        data = torch.empty(int(length[0]), dtype=torch.uint8)
    c.broadcast_(data, root_rank, names[1], process_set)
    if process.rank() == root_rank:
        return obj
    return pickle.load(io.BytesIO(data.numpy().tobytes()))


def allgather_object(obj: Any, name: str | None = None) -> list[Any]:
    """Every rank's object, in rank order (pickled; unnamed: named in call order)."""
    names = (None, None) if name is None else (f"{name}.sz", f"{name}.t")
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    lengths = allgather(torch.tensor([data.numel()], dtype=torch.int64), name=names[0])
    gathered = allgather(data, name=names[1]).numpy()
    out, start = [], 0
    for n in lengths.tolist():
        out.append(pickle.loads(gathered[start : start + n].tobytes()))
        start += n
    return out


def broadcast_optimizer_state(optimizer: Any, root_rank: int, model: Any = None) -> None:
    """Overwrite the optimizer's state and options with root rank's (see the module notes)."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    state_dict = optimizer.state_dict()
    if not state_dict["state"]:
        _initialise_state(optimizer, _sparse_params(model))
        state_dict = optimizer.state_dict()
    if not state_dict["state"]:
        return  # a stateless optimizer: nothing to broadcast
    tensors, scalars, assign = _split_state(optimizer, state_dict)
    broadcast_parameters(tensors, root_rank)
    for key, value in broadcast_object(scalars, root_rank).items():
        assign[key](value)


def _sparse_params(model: Any) -> set[int]:
    if model is None:
        return set()
    return {
        id(p)
        for m in model.modules()
        if isinstance(m, torch.nn.Embedding) and m.sparse
        for p in m.parameters()
    }


def _initialise_state(optimizer: Any, sparse: set[int]) -> None:
    """One step with zero gradients, so that the state exists (every rank alike)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
                if isinstance(optimizer, torch.optim.SparseAdam) or id(p) in sparse:
                    p.grad = p.grad.to_sparse()
    if is_distributed(optimizer):  # its step() would reduce: only some callers may be here
        super(type(optimizer).__mro__[1], optimizer).step()
    else:
        optimizer.step()


def _split_state(optimizer: Any, state_dict: dict) -> tuple[list, dict, dict]:
    """(named state tensors, scalar options and state by key, key -> how to put a value back)."""
    tensors, scalars, assign = [], {}, {}
    occurrences: dict[str, int] = collections.defaultdict(int)
    for index, group in enumerate(state_dict["param_groups"]):
        for key, value in group.items():
            if key == "params":
                continue
            scalars[f"{key}.{index}"] = value
            assign[f"{key}.{index}"] = _setter(optimizer.param_groups[index], key, value)
        for pid in group["params"]:
            for name, value in state_dict["state"].get(pid, {}).items():
                occurrences[name] += 1
                key = f"{name}.{occurrences[name]}"
                if torch.is_tensor(value):
                    tensors.append((key, value))
                else:
                    scalars[key] = value
                    assign[key] = _setter(optimizer.state[_param(optimizer, pid)], name, value)
    return tensors, scalars, assign


def _param(optimizer: Any, pid: int) -> Any:
    """The parameter that state_dict() numbered pid (its order over the param groups)."""
    return [p for g in optimizer.param_groups for p in g["params"]][pid]


def _setter(target: dict, key: str, mine: Any):
    """Assign root's value under key, cast to this rank's own type (nested tuples included)."""

    def assign(value: Any) -> None:
        target[key] = _cast(value, mine)

    return assign


def _cast(value: Any, like: Any) -> Any:
    if isinstance(like, (str, bytes)) or like is None or value is None or torch.is_tensor(like):
        return value
    if isinstance(like, Iterable) and isinstance(value, Iterable):
        return type(like)(_cast(v, l) for v, l in zip(value, like))
    try:
        return type(like)(value)
    except (TypeError, ValueError):
        return value
