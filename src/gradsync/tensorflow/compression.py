"""Gradient compression on ``tf.Tensor`` (``horovod.tensorflow.Compression``): what crosses the
wire, and how it comes back. The same plug-in interface as :class:`gradsync.Compressor`, written
with ``tf.cast`` so that it works eagerly and inside ``tf.function``."""

from __future__ import annotations

from typing import Any

import tensorflow as tf


class NoneCompressor:
    """No compression: the tensor itself is reduced."""

    @staticmethod
    def compress(tensor: tf.Tensor) -> tuple[tf.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: tf.Tensor, context: Any) -> tf.Tensor:
        return tensor


class CastCompressor:
    """Casts float32/float64 tensors to ``dtype`` (``tf.float16`` or ``tf.bfloat16``) for the
    reduction and back to their dtype afterwards; other dtypes pass unchanged."""

    def __init__(self, dtype: tf.DType) -> None:
        self.dtype = dtype

    def compress(self, tensor: tf.Tensor) -> tuple[tf.Tensor, Any]:
        if tensor.dtype not in (tf.float32, tf.float64):
            return tensor, None
        return tf.cast(tensor, self.dtype), tensor.dtype

    def decompress(self, tensor: tf.Tensor, context: Any) -> tf.Tensor:
        return tensor if context is None else tf.cast(tensor, context)

    def __repr__(self) -> str:
        return f"CastCompressor({self.dtype.name})"


class Compression:
    """The built-in compressors: ``Compression.none`` (default), ``Compression.fp16``,
    ``Compression.bf16``."""

    none = NoneCompressor()
    fp16 = CastCompressor(tf.float16)
    bf16 = CastCompressor(tf.bfloat16)
