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

from ..ops import barrier, join
from ..process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from ..protocol import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from ..runtime import (
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
from .compression import Compression
from .gradient_tape import (
    DistributedGradientTape,
    PartialDistributedGradientTape,
    allreduce_gradients,
    broadcast_variables,
)
from .mpi_ops import allgather, allreduce, alltoall, broadcast, grouped_allreduce, reducescatter

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "barrier", "join",
    "ProcessSet", "add_process_set", "remove_process_set", "global_process_set",
    "ReduceOp", "Average", "Sum", "Min", "Max", "Product", "Adasum", "Compression",
    "allreduce", "grouped_allreduce", "allgather", "broadcast", "alltoall", "reducescatter",
    "broadcast_variables", "allreduce_gradients",
    "DistributedGradientTape", "PartialDistributedGradientTape",
]
