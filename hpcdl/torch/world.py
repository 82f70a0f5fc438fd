"""The job a PyTorch script runs in, as an hpcdl World: from torch.distributed, MPI, or alone.

hpcdl's start-up (opening the data set once per job, the staging session, the error agreement)
talks to its World through a few mpi4py-spelled calls: `allgather`, `bcast`, `Barrier` on the
world and on the node. A script started by torchrun has torch.distributed and no MPI; one
started by mpirun or srun may have both. So:
- torch.distributed initialised: the calls go over gloo groups of their own (object
  collectives, small control messages only; gloo also when the script trains on NCCL, whose
  object collectives would need a GPU), and which ranks share a node is gathered by host name;
- not initialised but started by an MPI launcher (Open MPI, PMIx, PMI): hpcdl's own MPI World;
- neither: a world of one.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from hpcdl.comm.world import LAUNCHER_VARS, World, solo_world


class NotInitialised(RuntimeError):
    """torchrun started this process but the script has not initialised torch.distributed."""


class GlooComm:
    """allgather/bcast/Barrier of mpi4py's spelling over one torch.distributed gloo group."""

    def __init__(self, dist: Any, group: Any, ranks: list[int]) -> None:
        self.dist, self.group, self.ranks = dist, group, ranks  # ranks: world ranks, group order

    def Get_rank(self) -> int:  # noqa: N802 (mpi4py spelling)
        return self.ranks.index(self.dist.get_rank())

    def Get_size(self) -> int:  # noqa: N802
        return len(self.ranks)

    def allgather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * len(self.ranks)
        self.dist.all_gather_object(out, obj, group=self.group)
        return out

    def bcast(self, obj: Any, root: int = 0) -> Any:
        box = [obj]
        self.dist.broadcast_object_list(box, src=self.ranks[root], group=self.group)
        return box[0]

    def Barrier(self) -> None:  # noqa: N802
        self.dist.barrier(group=self.group)


def current_world() -> tuple[World, str]:
    """(this process's World, where it came from: 'torch.distributed', 'MPI' or 'alone')."""
    import torch.distributed as dist  # noqa: PLC0415

    if dist.is_available() and dist.is_initialized():
        return torch_world(dist), "torch.distributed"
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "TORCHELASTIC_RUN_ID" in os.environ:
        raise NotInitialised(
            "torchrun started this process but torch.distributed is not initialised; call "
            "torch.distributed.init_process_group() before creating the hpcdl.torch.Loader"
        )
    if any(key in os.environ for key in LAUNCHER_VARS):
        from hpcdl.comm.world import init_world  # noqa: PLC0415

        return init_world(), "MPI"
    return solo_world(), "alone"


def torch_world(dist: Any) -> World:
    """The World of an initialised torch.distributed job; collective (every rank calls it)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    # A group of our own: the script's collectives and ours never interleave on one group.
    everyone = GlooComm(dist, dist.new_group(backend="gloo"), list(range(size)))
    hosts = everyone.allgather(socket.gethostname())
    names = list(dict.fromkeys(hosts))  # nodes numbered in the order of their lowest rank
    ranks_by_node = tuple(tuple(r for r in range(size) if hosts[r] == h) for h in names)
    groups = [dist.new_group(list(ranks), backend="gloo") for ranks in ranks_by_node]
    node = names.index(hosts[rank])
    node_ranks = ranks_by_node[node]
    return World(
        comm=everyone,
        node_comm=GlooComm(dist, groups[node], list(node_ranks)),
        leaders_comm=None,  # hpcdl's data path never asks for it
        rank=rank,
        size=size,
        local_rank=node_ranks.index(rank),
        local_size=len(node_ranks),
        node_index=node,
        num_nodes=len(names),
        node_ranks=node_ranks,
        ranks_by_node=ranks_by_node,
    )
