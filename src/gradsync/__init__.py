"""gradsync: synchronous data-parallel training over MPI, in the style of Horovod.

Four lines turn a single-process PyTorch script into a data-parallel one::

    import gradsync
    gradsync.init()
    opt = gradsync.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    gradsync.broadcast_parameters(model.state_dict(), root_rank=0)

The core (this namespace minus the torch names) imports no deep-learning framework; the torch
adapter is imported when one of its names is first used.
"""

from __future__ import annotations

from . import metrics as metrics  # gradsync.metrics after `import gradsync` alone
from .backends.nccl_api import nccl_built, nccl_version
from .compression import Compression, Compressor
from .engine.protocol import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from .errors import (
    CollectiveError,
    GradsyncError,
    LaunchError,
    NotInitializedError,
    RankFailureError,
    ShutdownError,
    StallError,
)
from .handles import GroupHandle, Handle
from .ops import (
    allgather,
    allgather_async,
    allgather_object,
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
    broadcast_object,
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
    synchronize,
)

# Before anything can initialise MPI (no module here imports mpi4py.MPI): Open MPI told to yield the
# core in blocking calls unless the user chose otherwise (gradsync/process/mpi_environment.py).
from .process import mpi_environment as _mpi_environment  # noqa: F401  (its import sets the variable)
from .process.runtime import (
    cross_rank,
    cross_size,
    init,
    is_initialized,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
)
from .process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set

__version__ = "0.1.0"

_TORCH_NAMES = ("DistributedOptimizer", "ZeroRedundancyOptimizer", "broadcast_parameters",
                "broadcast_optimizer_state", "Bucket", "allreduce_hook", "fp16_compress_hook",
                "bf16_compress_hook", "PowerSGD")


def __getattr__(name: str):
    if name in _TORCH_NAMES:
        from . import torch as torch_adapter

        return getattr(torch_adapter, name)
    raise AttributeError(f"module 'gradsync' has no attribute {name!r}")


__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "broadcast_object",
    "allgather", "allgather_async", "allgather_object", "barrier", "join", "synchronize", "poll",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
    "grouped_reducescatter", "grouped_reducescatter_async", "grouped_allgather",
    "grouped_allgather_async",
    "ProcessSet", "add_process_set", "remove_process_set", "global_process_set",
    "ReduceOp", "Average", "Sum", "Min", "Max", "Product", "Adasum", "Handle", "GroupHandle",
    "nccl_built", "nccl_version", "Compression", "Compressor",
    "GradsyncError", "NotInitializedError", "LaunchError", "CollectiveError", "ShutdownError",
    "StallError", "RankFailureError",
    *_TORCH_NAMES,
]
