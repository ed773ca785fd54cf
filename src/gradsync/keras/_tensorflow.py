"""The TensorFlow backend of gradsync.keras: gradients are tf.Tensors inside the tf.function step.

:func:`gradsync.tensorflow.grouped_allreduce` is one ``tf.numpy_function`` op per dtype group in
the traced step, so the averaging runs inside ``model.fit``'s ``tf.function`` (and eagerly with
``run_eagerly=True``).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from ..engine.protocol import ReduceOp
from ..process_sets import ProcessSet
from ..tensorflow import grouped_allreduce as _grouped_allreduce


def grouped_allreduce(grads: list[Any], name: str, op: ReduceOp, process_set: ProcessSet) -> list[Any]:
    """Reduce ``grads`` (tf.Tensors, eager or symbolic) as one unit; returns new tensors in order."""
    return list(_grouped_allreduce(list(grads), op=op, process_set=process_set, name=name))


def densify(grads: list[Any]) -> list[Any]:
    """``grads`` with each ``tf.IndexedSlices`` (an embedding's gradient) made a dense tensor."""
    return [tf.convert_to_tensor(g) for g in grads]
