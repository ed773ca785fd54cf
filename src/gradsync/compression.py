"""Gradient compression for DistributedOptimizer: what travels, and how it comes back.

A compressor turns a gradient into the tensor that is allreduced (``compress``) and the reduced
tensor back into a gradient (``decompress``). Compression happens before fusion and decompression
after it, so compressed gradients are fused with each other like any others. The built-in ones cast
floating-point gradients to 16 bits: half the bytes on the wire, at the cost of rounding each rank's
gradient to 16 bits. On the host (MPI) gradsync sums 16-bit tensors in float32 and rounds the result
once; on GPUs with NCCL they are summed by NCCL in their own 16-bit dtype (docs/gpu.md), as
Horovod's NCCL path does. Same interface as Horovod's ``hvd.Compression``.

Write your own by implementing :class:`Compressor`'s two methods on any object; they receive and return
tensors of the framework in use (torch tensors for DistributedOptimizer).
"""

from __future__ import annotations

from typing import Any, Protocol

from .arrays.dispatch import adapter_for


class Compressor(Protocol):
    """The plug-in interface: a pair of functions around the allreduce."""

    def compress(self, tensor: Any) -> tuple[Any, Any]:
        """Return (the tensor to allreduce, a context for :meth:`decompress`).

        The returned tensor may be ``tensor`` itself (then it is reduced in place) or a new one; it
        must have a dtype gradsync reduces and the same shape on every rank.
        """

    def decompress(self, tensor: Any, context: Any) -> Any:
        """Return the gradient for the reduced ``tensor`` (``context`` is what compress returned).
        Its shape and dtype must be those of the original gradient."""


class NoneCompressor:
    """No compression: the gradient itself is reduced, in place."""

    def compress(self, tensor: Any) -> tuple[Any, Any]:
        return tensor, None

    def decompress(self, tensor: Any, context: Any) -> Any:
        return tensor


class CastCompressor:
    """Casts float32/float64 gradients to ``dtype`` ('float16' or 'bfloat16') for the allreduce and
    back afterwards; other dtypes (16-bit floats included) pass unchanged."""

    def __init__(self, dtype: str) -> None:
        if dtype not in ("float16", "bfloat16"):
            raise ValueError(f"gradsync: CastCompressor casts to float16 or bfloat16, not {dtype!r}")
        self.dtype = dtype

    def compress(self, tensor: Any) -> tuple[Any, Any]:
        original = _dtype_name(tensor)
        if original not in ("float32", "float64"):
            return tensor, None
        return _cast(tensor, self.dtype), original

    def decompress(self, tensor: Any, context: Any) -> Any:
        return tensor if context is None else _cast(tensor, context)

    def __repr__(self) -> str:
        return f"CastCompressor({self.dtype!r})"


class Compression:
    """The built-in compressors: ``Compression.none`` (default), ``Compression.fp16`` and
    ``Compression.bf16``."""

    none: Compressor = NoneCompressor()
    fp16: Compressor = CastCompressor("float16")
    bf16: Compressor = CastCompressor("bfloat16")


def _dtype_name(tensor: Any) -> str:
    return adapter_for(tensor).info(tensor).dtype


def _cast(tensor: Any, dtype: str) -> Any:
    """``tensor`` converted to the dtype named ``dtype`` (a new tensor of the same framework)."""
    return adapter_for(tensor).cast(tensor, dtype)
