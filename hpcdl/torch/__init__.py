"""hpcdl for PyTorch scripts: the data path (docs/torch.md) and Horovod's API (docs/horovod.md).

    import hpcdl.torch as hvd          # was: import horovod.torch as hvd
    hvd.init()
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    from hpcdl.torch import Loader
    loader = Loader(args.data, batch_size=64, epochs=args.epochs, stage_dir=args.stage_dir)

`pip install hpcdl[torch]`. PyTorch is imported only inside this package; the rest of hpcdl
never imports it. The Horovod names are Horovod 0.28.1's, with its signatures, defaults and
semantics, built on mpi4py and hpcdl's GradientReducer. Process sets, Adasum and elastic raise
NotBuilt (hpcdl.torch.unbuilt); the timeline (hvd.start_timeline) is hpcdl's own, written by
hpcdl.diag in Horovod's format (hpcdl.torch.timeline, docs/diagnose.md).
"""

from hpcdl.torch.autograd import (
    allgather,
    allreduce,
    alltoall,
    broadcast,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    reducescatter,
    sparse_allreduce_async,
)
from hpcdl.torch.collectives import (
    allgather_async,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall_async,
    barrier,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather_async,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter_async,
    join,
    poll,
    reducescatter_async,
    synchronize,
)
from hpcdl.torch.compression import Compression
from hpcdl.torch.dataloader import HpcdlSampler, HpcdlSamples
from hpcdl.torch.loader import Loader, LoaderStartError
from hpcdl.torch.optimizer import DistributedOptimizer
from hpcdl.torch.process import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    shutdown,
    size,
)
from hpcdl.torch.process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)
from hpcdl.torch.state_sync import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from hpcdl.torch.stop import stop_requested
from hpcdl.torch.sync_batch_norm import SyncBatchNorm
from hpcdl.torch.timeline import start_timeline, stop_timeline
from hpcdl.torch.unbuilt import HorovodInternalError, NotBuilt, elastic

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "DistributedOptimizer",
    "HorovodInternalError",
    "HpcdlSampler",
    "HpcdlSamples",
    "Loader",
    "LoaderStartError",
    "Max",
    "Min",
    "NotBuilt",
    "ProcessSet",
    "Product",
    "Sum",
    "SyncBatchNorm",
    "allgather_object",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "add_process_set",
    "allgather",
    "allgather_async",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "elastic",
    "gloo_built",
    "gloo_enabled",
    "global_process_set",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "init",
    "is_homogeneous",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "poll",
    "rank",
    "reducescatter",
    "reducescatter_async",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "sparse_allreduce_async",
    "start_timeline",
    "stop_requested",
    "stop_timeline",
    "synchronize",
]
