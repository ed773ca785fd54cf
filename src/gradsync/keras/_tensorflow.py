"""The TensorFlow backend of gradsync.keras: gradients are tf.Tensors inside the tf.function step.

The reduction is :func:`gradsync.tensorflow.gradient_tape.reduce_gradients`, DistributedGradientTape's
own: one ``tf.numpy_function`` op per dtype group of dense gradients (a grouped allreduce), and each
``tf.IndexedSlices`` allgathered and averaged, inside ``model.fit``'s ``tf.function`` (and eagerly
with ``run_eagerly=True``).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from ..engine.protocol import ReduceOp
from ..process_sets import ProcessSet
from ..tensorflow.compression import Compression
from ..tensorflow.gradient_tape import reduce_gradients


def grouped_allreduce(grads: list[Any], name: str, op: ReduceOp, process_set: ProcessSet,
                      prescale: float = 1.0, postscale: float = 1.0) -> list[Any]:
    """Reduce ``grads`` (tf.Tensors, eager or symbolic, or ``tf.IndexedSlices``) as one unit;
    returns new tensors in order."""
    return reduce_gradients(list(grads), op, prescale, postscale, Compression.none, process_set, name)


def densify(grads: list[Any]) -> list[Any]:
    """``grads`` with each ``tf.IndexedSlices`` (an embedding's gradient) made a dense tensor."""
    return [tf.convert_to_tensor(g) for g in grads]
