"""Horovod's compression classes (``horovod.torch.compression``) on gradsync's compressors.

``Compression`` is :class:`gradsync.Compression` (``none``, ``fp16``, and gradsync's ``bf16``).
``NoneCompressor`` and ``FP16Compressor`` are Horovod's classes, usable without an instance
(``FP16Compressor.compress(t)``) as in Horovod; they delegate to gradsync's ``Compression.none`` and
``Compression.fp16``. One difference: gradsync's fp16 casts float32 and float64 tensors only, and
leaves bfloat16 as it is (Horovod casts it to float16 too, losing its range).
"""

from __future__ import annotations

from typing import Any

from ..compression import Compression, Compressor

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "Compression"]


class NoneCompressor(Compressor):
    """No compression (Horovod's default): the tensor itself is reduced."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        """Returns ``(tensor, None)``."""
        return Compression.none.compress(tensor)

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        """Returns ``tensor``."""
        return Compression.none.decompress(tensor, ctx)


class FP16Compressor(Compressor):
    """float32/float64 tensors travel as float16 and come back in their own dtype."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        """Returns ``(tensor as float16, its dtype)``; other dtypes pass unchanged."""
        return Compression.fp16.compress(tensor)

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        """Returns ``tensor`` cast back to the dtype ``compress`` saw."""
        return Compression.fp16.decompress(tensor, ctx)
