"""``horovod.tensorflow.util``'s helper that Horovod's TensorFlow scripts and tests import."""

from __future__ import annotations

import tensorflow as tf


def _executing_eagerly() -> bool:
    """True outside a ``tf.function`` (and outside a TF1 graph): ``tf.executing_eagerly()``."""
    return tf.executing_eagerly()
