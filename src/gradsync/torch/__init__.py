"""The PyTorch adapter, and a drop-in for ``horovod.torch``: ``import gradsync.torch as hvd``.

Every public name of horovod.torch 0.28.1 is here with Horovod's signature, argument order and
semantics (docs/migrating-from-horovod.md lists each one and what differs), on gradsync's
coordinator: the collectives (differentiable, as Horovod's), ``DistributedOptimizer``,
``broadcast_parameters``, ``broadcast_optimizer_state``, ``SyncBatchNorm``, ``Adasum``, the build
flags and the dynamic timeline; gradsync's own communication hooks (``PowerSGD``) and
``ZeroRedundancyOptimizer``; ``elastic`` at a fixed number of ranks.
``DistributedOptimizer``, ``broadcast_parameters`` and
``broadcast_optimizer_state`` are also ``gradsync.``'s. The framework-agnostic ``gradsync``
namespace keeps its own API (``gradsync.allreduce`` has no ``average=`` and no autograd).

Importing it imports torch; ``import gradsync`` alone does not.
"""

from . import distributed, elastic
from .basics import (
    Adasum,
    Average,
    HorovodInternalError,
    Max,
    Min,
    ProcessSet,
    Product,
    Sum,
    add_process_set,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    handle_average_backwards_compatibility,
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
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from .comm_hooks import allreduce_hook, bf16_compress_hook, fp16_compress_hook
from .compression import Compression
from .functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from .mpi_ops import (
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    join,
    poll,
    reducescatter,
    reducescatter_async,
    sparse_allreduce_async,
    synchronize,
)
from .optimizer import DistributedOptimizer
from .powersgd import PowerSGD
from .reducer.buckets import Bucket
from .sync_batch_norm import SyncBatchNorm
from .zero import ZeroRedundancyOptimizer

distributed.register()  # the torch.distributed backend "gradsync" (docs/torch-distributed.md)

__all__ = [
    # gradsync's own, also in the gradsync namespace
    "DistributedOptimizer", "ZeroRedundancyOptimizer", "broadcast_parameters",
    "broadcast_optimizer_state",
    # gradsync's communication hooks (DDP's, not Horovod's)
    "Bucket", "allreduce_hook", "fp16_compress_hook", "bf16_compress_hook", "PowerSGD",
    # the rest of horovod.torch
    "init", "shutdown", "is_initialized", "start_timeline", "stop_timeline",
    "size", "local_size", "cross_size", "rank", "local_rank", "cross_rank", "is_homogeneous",
    "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built",
    "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
    "allreduce", "allreduce_async", "allreduce_", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_async", "grouped_allreduce_", "grouped_allreduce_async_",
    "sparse_allreduce_async", "allgather", "allgather_async", "grouped_allgather",
    "grouped_allgather_async", "broadcast", "broadcast_async", "broadcast_", "broadcast_async_",
    "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
    "grouped_reducescatter", "grouped_reducescatter_async", "join", "barrier", "poll", "synchronize",
    "broadcast_object", "allgather_object",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "HorovodInternalError",
    "handle_average_backwards_compatibility", "Compression", "SyncBatchNorm", "elastic",
]
