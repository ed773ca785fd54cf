"""The TensorFlow adapter: a drop-in for ``horovod.tensorflow`` (see docs/tensorflow.md).

Importing it imports TensorFlow; ``import gradsync`` alone does not. A Horovod TensorFlow 2
script changes its import only::

    import gradsync.tensorflow as hvd
    hvd.init()
    ...
    with tf.GradientTape() as tape:
        loss = loss_fn(model(x), y)
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    if first_step:
        hvd.broadcast_variables(model.variables, root_rank=0)
        hvd.broadcast_variables(opt.variables, root_rank=0)

The collectives take and return ``tf.Tensor`` and work eagerly and inside ``tf.function`` (each is
one ``tf.numpy_function`` op that calls gradsync's core; :mod:`gradsync.tensorflow.mpi_ops`
explains the ordering and naming rules there). Topology, process sets and reduce ops are
gradsync's own, re-exported under Horovod's names.
"""

from __future__ import annotations

from ..engine.protocol import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from ..ops import allgather_object, barrier, broadcast_object, join
from ..process.runtime import (
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
from ..process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from . import elastic, util
from .basics import (
    ccl_built,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    local_rank_op,
    local_size_op,
    mpi_built,
    mpi_enabled,
    nccl_built,
    rank_op,
    rocm_built,
    size_op,
)
from .compression import Compression
from .gradient_tape import (
    DistributedGradientTape,
    PartialDistributedGradientTape,
    allreduce_gradients,
)
from .grouped import (
    broadcast_,
    broadcast_global_variables,
    broadcast_variables,
    grouped_allgather,
    grouped_reducescatter,
)
from .mpi_ops import allgather, allreduce, alltoall, broadcast, grouped_allreduce, reducescatter
from .util import _executing_eagerly  # noqa: F401 - horovod.tensorflow has it (Horovod's tests use it)

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "barrier", "join", "broadcast_object", "allgather_object",
    "size_op", "rank_op", "local_size_op", "local_rank_op",
    "mpi_built", "mpi_enabled", "nccl_built", "gloo_built", "gloo_enabled", "ccl_built", "ddl_built",
    "rocm_built", "cuda_built", "util", "elastic",
    "ProcessSet", "add_process_set", "remove_process_set", "global_process_set",
    "ReduceOp", "Average", "Sum", "Min", "Max", "Product", "Adasum", "Compression",
    "allreduce", "grouped_allreduce", "allgather", "broadcast", "alltoall", "reducescatter",
    "grouped_allgather", "grouped_reducescatter",
    "broadcast_variables", "broadcast_", "broadcast_global_variables", "allreduce_gradients",
    "DistributedGradientTape", "PartialDistributedGradientTape",
]
