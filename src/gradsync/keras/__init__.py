"""Keras 3 data parallelism on any backend, a drop-in for ``horovod.tensorflow.keras``:
``import gradsync.keras as hvd``.

Choose the backend before importing keras (``KERAS_BACKEND=jax|torch|tensorflow``); gradsync.keras
reduces that backend's gradients through its adapter (gradsync.jax, gradsync.torch,
gradsync.tensorflow), inside ``model.fit``'s
compiled train step. Importing it imports keras; ``import gradsync`` alone does not::

    import gradsync.keras as hvd
    hvd.init()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size())), ...)
    model.fit(x_shard, y_shard, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                           hvd.callbacks.MetricAverageCallback()])

See docs/keras.md for Horovod's names mapped and each backend's notes.
"""

from __future__ import annotations

from .. import (
    Average,
    Compression,
    ProcessSet,
    Sum,
    add_process_set,
    cross_rank,
    cross_size,
    global_process_set,
    init,
    is_initialized,
    local_rank,
    local_size,
    rank,
    remove_process_set,
    shutdown,
    size,
)
from . import callbacks, elastic
from .collectives import allgather, allreduce, broadcast, reducescatter
from .optimizer import DistributedOptimizer, PartialDistributedOptimizer, broadcast_variables, load_model

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank",
    "cross_size", "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "Average", "Sum", "Compression", "DistributedOptimizer", "PartialDistributedOptimizer",
    "broadcast_variables", "load_model",
    "callbacks", "elastic", "allreduce", "allgather", "broadcast", "reducescatter",
]
