"""Horovod's compression classes (``horovod.torch.compression``) on gradsync's compressors.

``Compression`` is :class:`gradsync.Compression` (``none``, ``fp16``, and gradsync's ``bf16``).
``NoneCompressor`` and ``FP16Compressor`` are Horovod's classes, usable without an instance
(``FP16Compressor.compress(t)``) as in Horovod; they delegate to gradsync's ``Compression.none`` and
``Compression.fp16``. One difference: gradsync's fp16 casts float32 and float64 tensors only, and
leaves bfloat16 as it is (Horovod casts it to float16 too, losing its range).
"""

from __future__ import annotations

from ..compression import Compression, Compressor

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "Compression"]


def _usable_without_an_instance(name: str, compressor: Compressor, doc: str) -> type:
    """A Compressor subclass whose compress/decompress are ``compressor``'s, as static methods."""
    return type(name, (Compressor,), {"__doc__": doc, "__module__": __name__,
                                      "compress": staticmethod(compressor.compress),
                                      "decompress": staticmethod(compressor.decompress)})


NoneCompressor = _usable_without_an_instance(
    "NoneCompressor", Compression.none, "No compression (Horovod's default): the tensor itself is reduced.")
FP16Compressor = _usable_without_an_instance(
    "FP16Compressor", Compression.fp16,
    "float32/float64 tensors travel as float16 and come back in their own dtype.")
