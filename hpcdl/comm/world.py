"""The MPI world of one training process: world, node-local and node-leader communicators."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


@dataclass
class World:
    """Communicators and coordinates of this rank.

    comm: all ranks. node_comm: the ranks sharing this node (MPI_COMM_TYPE_SHARED).
    leaders_comm: one rank per node (local rank 0), None on the other ranks.
    """

    comm: Any
    node_comm: Any
    leaders_comm: Any | None
    rank: int
    size: int
    local_rank: int
    local_size: int
    node_index: int
    num_nodes: int

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    @property
    def is_node_leader(self) -> bool:
        return self.local_rank == 0


def init_world() -> World:
    """Initialise MPI (a singleton run without mpirun is a world of 1) and split it by node."""
    from mpi4py import MPI  # noqa: PLC0415  (import starts MPI; keep it out of module import)

    comm = MPI.COMM_WORLD
    node_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    local_rank = node_comm.rank
    leaders_comm = comm.Split(0 if local_rank == 0 else MPI.UNDEFINED, key=comm.rank)
    if leaders_comm == MPI.COMM_NULL:
        leaders_comm = None
    node_index = leaders_comm.rank if leaders_comm is not None else 0
    num_nodes = leaders_comm.size if leaders_comm is not None else 0
    node_index = node_comm.bcast(node_index, root=0)
    num_nodes = node_comm.bcast(num_nodes, root=0)
    return World(
        comm=comm,
        node_comm=node_comm,
        leaders_comm=leaders_comm,
        rank=comm.rank,
        size=comm.size,
        local_rank=local_rank,
        local_size=node_comm.size,
        node_index=node_index,
        num_nodes=num_nodes,
    )


def env_local_rank() -> int | None:
    """Local rank announced by the launcher (Open MPI, Slurm, MPICH), before MPI starts."""
    for key in ("OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "MPI_LOCALRANKID", "PMI_LOCAL_RANK"):
        value = os.environ.get(key)
        if value is not None and value.isdigit():
            return int(value)
    return None
