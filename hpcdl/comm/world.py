"""The MPI world of one training process: world, node-local and node-leader communicators."""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from hpcdl.mpi_errors import lost_ranks, revoke_quietly


@dataclass
class World:
    """Communicators and coordinates of this rank.

    comm: all ranks. node_comm: the ranks sharing this node (MPI_COMM_TYPE_SHARED).
    leaders_comm: one rank per node (local rank 0), None on the other ranks.
    Nodes are numbered in the order of their lowest world rank; local ranks in world-rank
    order. node_ranks and ranks_by_node are gathered, not computed: launchers place ranks node
    by node, round robin (`mpirun --map-by node`, Slurm cyclic) or unevenly.
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
    node_ranks: tuple[int, ...]  # world ranks on this node, in local-rank order
    ranks_by_node: tuple[tuple[int, ...], ...]  # node_ranks of every node, by node index
    thread_multiple: bool = True  # MPI granted MPI_THREAD_MULTIPLE (helper threads may call it)
    hosts: tuple[str, ...] = ()  # host name of every rank, by rank

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    @property
    def is_node_leader(self) -> bool:
        return self.local_rank == 0

    def per_node(self, shared: dict[str, Any], summed: dict[str, int]) -> list[dict] | None:
        """One record per node, by node index, on rank 0 (None elsewhere). Collective.

        A record holds the node's hostname ("node"), `shared` as the node's local rank 0 has
        it, and `summed` added up over the node's ranks. Small control values only (pickled)."""
        totals = self.node_comm.reduce(np.array(list(summed.values()), dtype=np.int64), root=0)
        record = None
        if self.is_node_leader:
            record = {"node": socket.gethostname(), **shared}
            record.update(zip(summed, (int(t) for t in totals)))
        records = self.comm.gather(record, root=0)
        return [r for r in records if r is not None] if records is not None else None


class SoloComm:
    """mpi4py's calls that hpcdl's start-up makes (rank, size, allgather, bcast, Barrier), for
    a world of one process."""

    def Get_rank(self) -> int:  # noqa: N802 (mpi4py spelling)
        return 0

    def Get_size(self) -> int:  # noqa: N802
        return 1

    def allgather(self, obj: Any) -> list[Any]:
        return [obj]

    def bcast(self, obj: Any, root: int = 0) -> Any:
        return obj

    def Barrier(self) -> None:  # noqa: N802
        pass


def solo_world() -> World:
    """The World of a process alone, without MPI: every communicator a SoloComm."""
    solo = SoloComm()
    return World(solo, solo, solo, 0, 1, 0, 1, 0, 1, (0,), ((0,),))


_THREAD_LEVELS = {0: "MPI_THREAD_SINGLE", 1: "MPI_THREAD_FUNNELED", 2: "MPI_THREAD_SERIALIZED"}


# Set by the launchers that start ranks (Open MPI's mpirun, PMIx and PMI: srun, Hydra).
LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE")


def start_mpi() -> Any:
    """mpi4py's MPI module, started (importing it calls MPI_Init_thread; keep it out of module
    import): at MPI_THREAD_MULTIPLE unless MPI4PY_RC_THREAD_LEVEL says otherwise, since the
    reducer's and the failure notices' threads call MPI.

    A singleton (a process no launcher started) starts without Open MPI's shared-memory
    transport: it has no peer to share memory with, and Open MPI 5 gives it a 16 MiB backing
    file in /dev/shm that only a launcher's clean-up removes, so each run without mpirun left
    one. OMPI_MCA_btl is set for MPI_Init alone and removed after, so that processes this one
    starts (an mpirun) never inherit it; a user's own OMPI_MCA_btl wins."""
    import mpi4py  # noqa: PLC0415

    if "MPI4PY_RC_THREAD_LEVEL" not in os.environ:  # the user's choice wins (tests force less)
        mpi4py.rc.thread_level = "multiple"
    singleton = not any(var in os.environ for var in LAUNCHER_VARS)
    if not singleton or "OMPI_MCA_btl" in os.environ or "mpi4py.MPI" in sys.modules:
        from mpi4py import MPI  # noqa: PLC0415

        return MPI
    os.environ["OMPI_MCA_btl"] = "self"
    try:
        from mpi4py import MPI  # noqa: PLC0415
    finally:
        del os.environ["OMPI_MCA_btl"]
    return MPI


def init_world() -> World:
    """Initialise MPI (a singleton run without mpirun is a world of 1) and split it by node."""
    MPI = start_mpi()  # noqa: N806 (mpi4py's module name)
    comm = MPI.COMM_WORLD
    thread_multiple = MPI.Query_thread() >= MPI.THREAD_MULTIPLE
    if not thread_multiple and comm.rank == 0:
        print(
            f"hpcdl: MPI granted {_THREAD_LEVELS.get(MPI.Query_thread(), 'a lower level')}, not "
            "MPI_THREAD_MULTIPLE: gradients are reduced on the training thread after backward "
            "(no overlap with it); use an MPI built with thread support for overlap",
            file=sys.stderr,
            flush=True,
        )
    return build_world(comm)


def build_world(comm: Any) -> World:
    """The World of comm's ranks (COMM_WORLD, or the survivors' communicator after a loss,
    hpcdl.comm.ulfm): split by node. Collective over comm."""
    from mpi4py import MPI  # noqa: PLC0415

    thread_multiple = MPI.Query_thread() >= MPI.THREAD_MULTIPLE
    made = [comm]
    try:
        node_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
        made.append(node_comm)
        local_rank = node_comm.rank
        leaders_comm = comm.Split(0 if local_rank == 0 else MPI.UNDEFINED, key=comm.rank)
        if leaders_comm == MPI.COMM_NULL:
            leaders_comm = None
        else:
            made.append(leaders_comm)
        node_index = leaders_comm.rank if leaders_comm is not None else 0
        num_nodes = leaders_comm.size if leaders_comm is not None else 0
        node_index = node_comm.bcast(node_index, root=0)
        num_nodes = node_comm.bcast(num_nodes, root=0)
        node_ranks = tuple(node_comm.allgather(comm.rank))
        by_leader = leaders_comm.allgather(node_ranks) if leaders_comm is not None else ()
        ranks_by_node = node_comm.bcast(tuple(by_leader), root=0)
    except MPI.Exception as exc:
        if lost_ranks(exc):  # a rank lost meanwhile (ULFM): ranks waiting on any of these leave
            for built in made:
                revoke_quietly(built)
        raise
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
        node_ranks=node_ranks,
        ranks_by_node=ranks_by_node,
        thread_multiple=thread_multiple,
        hosts=tuple(comm.allgather(socket.gethostname())),
    )
