"""Horovod's Keras collectives on values (``horovod.tensorflow.keras.allreduce``, ``allgather``,
``broadcast``, ``reducescatter``), on any Keras backend.

Each takes a tensor-compatible value (a numpy array, a number, a list, any backend's tensor),
moves it to host memory (``keras.ops.convert_to_numpy``), runs gradsync's collective on it and
returns the result as a tensor of the running backend (``keras.ops.convert_to_tensor``), as
Horovod's return a ``tf.Tensor`` under TensorFlow 2. They are for values outside the train step
(metrics, counters); inside it :class:`DistributedOptimizer` does the reducing.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from .. import ops
from ..compression import Compression, Compressor
from ..engine.protocol import ReduceOp
from ..process_sets import ProcessSet, global_process_set


def _host(value: Any) -> np.ndarray:
    """``value`` as a C-contiguous numpy array of its own shape (0-d included). Python numbers and
    lists of them take the dtype the backend gives them (``keras.ops.convert_to_tensor``: float32,
    int32), as Horovod's ``tf.constant(value)`` does; arrays and tensors keep theirs."""
    if isinstance(value, (bool, int, float, list, tuple)) and not isinstance(value, np.generic):
        value = keras.ops.convert_to_tensor(value)
    array = np.asarray(keras.ops.convert_to_numpy(value))
    return array if array.flags.c_contiguous else array.copy()


def allreduce(value: Any, name: str | None = None, average: bool | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, op: ReduceOp | None = None,
              compression: Compressor = Compression.none,
              process_set: ProcessSet = global_process_set) -> Any:
    """The reduction of ``value`` over every rank (same shape and dtype on every rank).

    ``op`` defaults to Average; Horovod's deprecated ``average=False`` means Sum (``op`` and
    ``average`` together: ValueError). ``compression`` is accepted for Horovod's signature: the
    value travels as it is (gradsync compresses gradients in :class:`DistributedOptimizer`).

    Raises:
        ValueError: both ``op`` and ``average`` given.
        gradsync.CollectiveError: the ranks' shapes or dtypes differ (the message names each rank's).
    """
    if op is not None and average is not None:
        raise ValueError(f"gradsync.keras.allreduce({name!r}): pass op= or average=, not both")
    op = ReduceOp(op) if op is not None else (ReduceOp.Sum if average is False else ReduceOp.Average)
    array = _host(value)
    out = ops.allreduce(array, name=name, op=op, prescale_factor=prescale_factor,
                        postscale_factor=postscale_factor, process_set=process_set)
    return keras.ops.convert_to_tensor(np.reshape(out, array.shape))


def allgather(value: Any, name: str | None = None, process_set: ProcessSet = global_process_set) -> Any:
    """Every rank's ``value`` concatenated along the first dimension, in rank order (the first
    dimension may differ between ranks, the others not).

    Raises:
        gradsync.CollectiveError: the ranks' trailing shapes or dtypes differ.
    """
    array = _host(value)
    return keras.ops.convert_to_tensor(ops.allgather(array.reshape(array.shape or (1,)), name=name,
                                                     process_set=process_set))


def broadcast(value: Any, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> Any:
    """``root_rank``'s ``value``, on every rank.

    Raises:
        ValueError: ``root_rank`` is not a rank of ``process_set``.
        gradsync.CollectiveError: the ranks' shapes or dtypes differ.
    """
    array = _host(value)
    out = ops.broadcast(array, root_rank, name=name, process_set=process_set)
    return keras.ops.convert_to_tensor(np.reshape(out, array.shape))


def reducescatter(value: Any, name: str | None = None, op: ReduceOp = ReduceOp.Average,
                  process_set: ProcessSet = global_process_set) -> Any:
    """This rank's block of rows of the reduction of ``value`` over every rank (the first
    dimension split as evenly as it goes, the first ranks taking one more row).

    Raises:
        gradsync.CollectiveError: the ranks' shapes or dtypes differ.
    """
    return keras.ops.convert_to_tensor(ops.reducescatter(_host(value), name=name, op=ReduceOp(op),
                                                         process_set=process_set))
