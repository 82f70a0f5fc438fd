"""Horovod's process functions for hpcdl.torch: init, shutdown, rank and size, the build queries.

`init()` builds an hpcdl World (hpcdl.comm.world: MPI_THREAD_MULTIPLE asked for, node-local
communicator by MPI_COMM_TYPE_SHARED) and starts the engine that runs the named collectives
(hpcdl.torch.engine). The CUDA-awareness decision is hpcdl's (hpcdl.comm.cuda_aware.detect),
made once here when torch sees a GPU: GPU tensors then go to MPI directly, or through pinned
host buffers (hpcdl.torch.transfer).

The `*_built` / `*_enabled` answers are the truth about this implementation: it is built on
MPI (mpi4py), never on Gloo, NCCL, DDL, oneCCL or ROCm; `cuda_built()` says whether torch can
reach a GPU, the only CUDA this package needs.
"""

from __future__ import annotations

import atexit
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hpcdl.comm.world import World
from hpcdl.torch.ops import Adasum, Average, Max, Min, Product, Sum  # noqa: F401

_NOT_INITIALISED = "Horovod has not been initialized; use hvd.init()."


@dataclass
class _State:
    """What init() made; None before init() and after shutdown()."""

    world: World
    engine: Any  # hpcdl.torch.engine.Engine
    cuda_aware: bool  # GPU tensors go to MPI directly (else through pinned host memory)
    cuda_reason: str
    thread_multiple: bool


_state: _State | None = None


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Start hpcdl.torch's collectives over MPI (every rank calls it; a second call is a no-op).

    comm: None (every rank of MPI_COMM_WORLD), an mpi4py communicator (duplicated), or a list
    of MPI_COMM_WORLD ranks. process_sets: only None or "dynamic" with no sets added; process
    sets are not built (hpcdl.torch.unbuilt).

    Like hpcdl.train, it makes an uncaught exception on any rank end the whole job
    (hpcdl.comm.failure.install_abort_on_exception: the failing rank prints its traceback once,
    the others one line, then MPI_Abort), since Open MPI would otherwise keep the other ranks
    waiting in a collective, and the failed one in MPI_Finalize, for ever (docs/horovod.md)."""
    global _state
    from hpcdl.torch import unbuilt  # noqa: PLC0415

    if process_sets not in (None, "dynamic", []):
        raise unbuilt.not_built("process sets (hvd.init(process_sets=...))")
    if _state is not None:
        return
    world = _world_of(comm)
    if world is None:  # this rank is not in the list of ranks given
        return
    from hpcdl.torch.engine import Engine  # noqa: PLC0415

    aware, reason = _cuda_awareness(world.comm)
    from hpcdl.comm.failure import install_abort_on_exception  # noqa: PLC0415

    install_abort_on_exception(world.comm, world.rank)  # collective: every rank, once
    engine = Engine(world.comm, aware)
    _state = _State(world, engine, aware, reason, world.thread_multiple)
    atexit.register(shutdown)  # before MPI_Finalize (registered earlier, so run later)


# Called by shutdown() before the engine goes (collective ends, such as a timeline's merge).
AT_SHUTDOWN: list[Callable[[], None]] = []


def shutdown() -> None:
    """Free the engine's communicator; hvd.init() may be called again afterwards."""
    global _state
    if _state is not None:
        while AT_SHUTDOWN:
            AT_SHUTDOWN.pop()()
        engine, _state = _state.engine, None
        engine.close()


def is_initialized() -> bool:
    """Whether init() has run (and shutdown() not since).

    Returns:
        A bool."""
    return _state is not None


def state() -> _State:
    """What init() made; ValueError (Horovod's) before init()."""
    if _state is None:
        raise ValueError(_NOT_INITIALISED)
    return _state


def size() -> int:
    """The number of processes (ranks) in the job; ValueError before init().

    Returns:
        An int: the number of processes (ranks) in the job."""
    return state().world.size


def rank() -> int:
    """This process's rank in the job; ValueError before init().

    Returns:
        An int: this process's rank in the job, 0 .. size() - 1."""
    return state().world.rank


def local_size() -> int:
    """The number of processes on this node; ValueError before init().

    Returns:
        An int: the number of processes on this node."""
    return state().world.local_size


def local_rank() -> int:
    """This process's rank on its node; ValueError before init().

    Returns:
        An int: this process's rank on its node, 0 .. local_size() - 1."""
    return state().world.local_rank


def cross_size() -> int:
    """Ranks with this rank's local rank, one per node (the nodes, when every node has as
    many ranks)."""
    world = state().world
    return sum(1 for ranks in world.ranks_by_node if len(ranks) > world.local_rank)


def cross_rank() -> int:
    """This rank's place among the ranks of the same local rank (its node's index when every
    node has as many ranks)."""
    world = state().world
    return sum(
        1 for ranks in world.ranks_by_node[: world.node_index] if len(ranks) > world.local_rank
    )


def is_homogeneous() -> bool:
    """Every node runs as many ranks."""
    return len({len(ranks) for ranks in state().world.ranks_by_node}) == 1


def mpi_threads_supported() -> bool:
    """MPI granted MPI_THREAD_MULTIPLE (scripts may call mpi4py from other threads)."""
    return state().thread_multiple


def mpi_enabled() -> bool:
    """Horovod's build question; hpcdl.torch always runs its collectives over MPI (mpi4py).

    Returns:
        True."""
    return True


def mpi_built() -> bool:
    """Horovod's build question; hpcdl.torch is built on MPI (mpi4py).

    Returns:
        True."""
    return True


def gloo_enabled() -> bool:
    """Horovod's build question; hpcdl.torch has no Gloo controller.

    Returns:
        False."""
    return False


def gloo_built() -> bool:
    """Horovod's build question; hpcdl.torch has no Gloo controller.

    Returns:
        False."""
    return False


def nccl_built() -> int:
    """Horovod's build question: the NCCL version built in; hpcdl.torch has no NCCL path.

    Returns:
        0 (Horovod's answer without NCCL)."""
    return 0


def ddl_built() -> bool:
    """Horovod's build question; no IBM DDL support.

    Returns:
        False."""
    return False


def ccl_built() -> bool:
    """Horovod's build question; no oneCCL support.

    Returns:
        False."""
    return False


def cuda_built() -> bool:
    """Horovod's build question: whether GPU tensors can be reduced.

    Returns:
        True when PyTorch sees a CUDA device (hpcdl.torch reduces them through CuPy and MPI,
        CUDA-aware or via host memory; hvd.cuda_aware() says which)."""
    import torch  # noqa: PLC0415

    return torch.cuda.is_available()


def rocm_built() -> bool:
    """Horovod's build question; no ROCm support.

    Returns:
        False."""
    return False


def cuda_aware() -> tuple[bool, str]:
    """(GPU tensors go to MPI without a host copy, why): hpcdl.comm.cuda_aware's decision."""
    current = state()
    return current.cuda_aware, current.cuda_reason


def _cuda_awareness(comm: Any) -> tuple[bool, str]:
    import torch  # noqa: PLC0415

    from hpcdl.comm.cuda_aware import detect  # noqa: PLC0415

    answer = detect(comm, "cuda" if torch.cuda.is_available() else "cpu")
    return answer.aware, answer.reason


def _world_of(comm: Any) -> World | None:
    """hpcdl's World over MPI_COMM_WORLD, or over the communicator or ranks the script gave."""
    from hpcdl.comm.world import init_world, start_mpi  # noqa: PLC0415

    if comm is None or comm == []:
        return init_world()
    MPI = start_mpi()  # noqa: N806 (mpi4py's module name)
    if isinstance(comm, MPI.Comm):
        return _split_world(comm.Dup())
    ranks = [int(r) for r in comm]
    group = MPI.COMM_WORLD.Get_group().Incl(ranks)
    sub = MPI.COMM_WORLD.Create_group(group)
    group.Free()
    return None if sub == MPI.COMM_NULL else _split_world(sub)


def _split_world(comm: Any) -> World:
    """A World over any communicator: its node-local part and its ranks per node (gathered)."""
    from mpi4py import MPI  # noqa: PLC0415

    node_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    node_ranks = tuple(node_comm.allgather(comm.rank))
    everyone = comm.allgather(node_ranks)
    ranks_by_node = tuple(dict.fromkeys(everyone))  # nodes in the order of their lowest rank
    return World(
        comm=comm,
        node_comm=node_comm,
        leaders_comm=None,  # hpcdl.torch's collectives never ask for it
        rank=comm.rank,
        size=comm.size,
        local_rank=node_comm.rank,
        local_size=node_comm.size,
        node_index=ranks_by_node.index(node_ranks),
        num_nodes=len(ranks_by_node),
        node_ranks=node_ranks,
        ranks_by_node=ranks_by_node,
        thread_multiple=MPI.Query_thread() >= MPI.THREAD_MULTIPLE,
    )
