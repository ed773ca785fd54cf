"""Communication hooks: how one bucket of gradients is reduced, as a plug-in.

A hook is any callable ``hook(bucket) -> future``: it receives a
:class:`~gradsync.torch.reducer.buckets.Bucket` (the flat buffer of several gradients, their names, offsets
and shapes, the op, the process set and the step), starts its collectives with gradsync's public asynchronous
ops, and returns an object whose ``wait()`` returns a 1-D tensor of the buffer's size, dtype and device
holding the reduced bucket (``bucket.op`` across ``bucket.process_set``): the buffer itself when the hook
reduced it in place, or another tensor that gradsync copies in. A gradsync :class:`~gradsync.Handle` of an
in-place allreduce of the buffer is such an object. Same idea as DDP's ``register_comm_hook``;
docs/comm-hooks.md shows how to write one.

Collective safety: which collectives a hook starts, their names, shapes and dtypes must depend only
on what is the same on every rank (the bucket's shapes, names and step, the hook's own settings),
never on the gradients' values or on a rank's own counters. ``wait()`` may start further
collectives: gradsync calls the waits of a round in bucket order on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from .. import ops
from ..compression import Compressor
from .reducer.buckets import Bucket


class Future(Protocol):
    """What a hook returns."""

    def wait(self) -> torch.Tensor:
        """Block until the bucket is reduced; return it (1-D, the buffer's size, dtype, device)."""


class CommHook(Protocol):
    """The hook interface: called once per bucket and round, when its last gradient is ready."""

    def __call__(self, bucket: Bucket) -> Future:
        """Start reducing ``bucket``; return a future of the reduced flat bucket."""


class Then:
    """A future made of a gradsync handle and what to do with its result: ``wait()`` returns
    ``finish(handle.wait())``."""

    def __init__(self, handle: Any, finish: Callable[[Any], torch.Tensor]) -> None:
        self.handle = handle
        self.finish = finish

    def wait(self) -> torch.Tensor:
        return self.finish(self.handle.wait())


def allreduce_hook(bucket: Bucket) -> Future:
    """The default hook: one in-place allreduce (``bucket.op``) of the whole bucket buffer; same
    numbers as DistributedOptimizer without a hook (an allreduce of each large gradient, and one
    per bucket of small ones: :class:`CompressedAllreduce` with no compression).

    Raises:
        the errors of :func:`gradsync.allreduce_async_` (from ``wait()``: CollectiveError, ...).
    """
    return ops.allreduce_async_(bucket.buffer, name=bucket.name, op=bucket.op,
                                process_set=bucket.process_set)


def fp16_compress_hook(bucket: Bucket) -> Future:
    """Allreduce the bucket cast to float16 (half the bytes of float32), then cast back: the
    numbers of ``compression=gradsync.Compression.fp16``. On the host the float16 values are summed
    in float32 and the result rounded to float16 once; NCCL sums in float16. Buckets of another
    dtype than float32/float64 are allreduced as they are."""
    return _cast_hook(bucket, torch.float16)


def bf16_compress_hook(bucket: Bucket) -> Future:
    """As :func:`fp16_compress_hook`, in bfloat16 (float32's range, 8 bits of mantissa)."""
    return _cast_hook(bucket, torch.bfloat16)


def _cast_hook(bucket: Bucket, dtype: torch.dtype) -> Future:
    buffer = bucket.buffer
    if buffer.dtype not in (torch.float32, torch.float64):
        return allreduce_hook(bucket)
    handle = ops.allreduce_async_(buffer.to(dtype), name=bucket.name, op=bucket.op,
                                  process_set=bucket.process_set)
    return Then(handle, buffer.copy_)


class CompressedAllreduce:
    """The hook DistributedOptimizer uses when none is given and buckets are on: the bucket
    compressed by ``compression`` (as one tensor), allreduced with the optimizer's scale factors,
    and decompressed; with ``Compression.none``, an in-place allreduce of the buffer."""

    def __init__(self, compression: Compressor, prescale: float, postscale: float) -> None:
        self.compression = compression
        self.prescale = prescale
        self.postscale = postscale

    def __call__(self, bucket: Bucket) -> Future:
        compressed, context = self.compression.compress(bucket.buffer)
        handle = ops.allreduce_async_(compressed, name=bucket.name, op=bucket.op,
                                      prescale_factor=self.prescale, postscale_factor=self.postscale,
                                      process_set=bucket.process_set)
        if compressed is bucket.buffer:
            return handle
        return Then(handle, lambda reduced: self.compression.decompress(reduced, context))
