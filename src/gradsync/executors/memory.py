"""Copy primitives: the only thing a framework supplies to the execution of a plan.

A :class:`~gradsync.executors.plan.FusionPlan` says which copies pack tensors into a buffer and unpack the
results; :func:`gradsync.executors.plan.pack` and :func:`gradsync.executors.plan.unpack` carry them out, once
for every kind of memory, through a :class:`Memory`. :data:`HOST` is numpy's; a device tensor's is
:class:`DeviceMemory`, which enqueues the same copies through its framework's
:class:`~gradsync.arrays.device.DeviceRuntime` on the current CUDA stream.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np


class Memory(Protocol):
    """Copies between tensors and 1-d buffer slices of one kind of memory."""

    def contiguous(self, array: Any) -> bool:
        """Whether ``array`` is C-contiguous and writable: a backend may reduce it in place."""

    def readable(self, array: Any, dtype: np.dtype) -> bool:
        """Whether ``array`` is C-contiguous and of ``dtype``: a backend may send from its memory."""

    def flat(self, array: Any) -> Any:
        """A 1-d view of the C-contiguous ``array``, sharing its memory."""

    def copy(self, source: Any, target: Any, scale: float) -> None:
        """``target[...] = source * scale``, cast to ``target``'s dtype, computed in the wider of the
        two dtypes (so a 16-bit tensor is scaled in its float32 buffer and rounded once). Both hold
        the same number of elements; a 1-d side (a buffer slice) is viewed in the other's shape."""

    def floor_divide(self, array: Any, divisor: int) -> None:
        """``array //= divisor`` in place (an integer Average: the floor of the exact mean)."""


class HostMemory:
    """numpy arrays in host memory."""

    def contiguous(self, array: np.ndarray) -> bool:
        return array.flags.c_contiguous and array.flags.writeable

    def readable(self, array: np.ndarray, dtype: np.dtype) -> bool:
        return array.flags.c_contiguous and array.dtype == dtype

    def flat(self, array: np.ndarray) -> np.ndarray:
        return array if array.ndim == 1 else array.reshape(-1)

    def copy(self, source: np.ndarray, target: np.ndarray, scale: float) -> None:
        source, target = same_shape(source, target)
        if scale == 1.0:
            np.copyto(target, source, casting="unsafe")
        elif target.dtype.itemsize > source.dtype.itemsize:  # in the (wider) buffer's precision
            np.multiply(source, scale, out=target, dtype=target.dtype, casting="unsafe")
        else:  # in the source's precision, rounded once into the target
            np.multiply(source, scale, out=target, casting="unsafe")

    def floor_divide(self, array: np.ndarray, divisor: int) -> None:
        np.floor_divide(array, divisor, out=array)


HOST = HostMemory()


@dataclasses.dataclass(frozen=True, eq=False)
class DeviceMemory:
    """Device arrays of one framework on one GPU: the copies are enqueued on the current stream."""

    runtime: Any  # a gradsync.arrays.device.DeviceRuntime
    device: int

    def contiguous(self, array: Any) -> bool:
        return self.runtime.is_contiguous(array)

    def readable(self, array: Any, dtype: np.dtype) -> bool:
        return False  # no device backend reads a separate source (Traits.reduces_from_source)

    def flat(self, array: Any) -> Any:
        return self.runtime.flat(array)

    def copy(self, source: Any, target: Any, scale: float) -> None:
        self.runtime.copy(source, target, scale)

    def floor_divide(self, array: Any, divisor: int) -> None:
        self.runtime.floor_divide(array, divisor)


def same_shape(source: Any, target: Any) -> tuple[Any, Any]:
    """``source`` and ``target`` (same element count) in one shape: the 1-d one viewed in the
    other's (numpy-style ``reshape``; a buffer slice is contiguous, so that is a view)."""
    if tuple(source.shape) == tuple(target.shape):
        return source, target
    if len(target.shape) == 1:
        return source, target.reshape(source.shape)
    return source.reshape(target.shape), target


class FusionBuffers:
    """One reusable flat buffer per key, grown on demand and never shrunk.

    By default the key is an accumulator dtype and the buffers are host numpy arrays; with
    ``allocate(key, count)`` (returning a 1-d array of at least ``count`` elements that supports
    ``shape`` and slicing) the keys and the memory are the caller's: device fusion buffers keyed
    by (runtime, device, dtype), pinned staging buffers keyed by (runtime, use, dtype).
    """

    def __init__(self, allocate: Callable[[Any, int], Any] | None = None) -> None:
        self._allocate = allocate or (lambda dtype, count: np.empty(count, dtype=dtype))
        self._buffers: dict[Any, Any] = {}

    def get(self, key: Any, count: int) -> Any:
        """A contiguous 1-d array of ``count`` elements for ``key`` (contents undefined)."""
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape[0] < count:
            buffer = self._buffers[key] = self._allocate(key, max(count, 1))
        return buffer[:count]

    def fits(self, key: Any, count: int) -> bool:
        """Whether :meth:`get` of ``count`` elements reuses the buffer it has (does not replace it)."""
        buffer = self._buffers.get(key)
        return buffer is not None and buffer.shape[0] >= count

    def clear(self) -> None:
        """Drop every buffer (they are freed once no one else holds them)."""
        self._buffers.clear()
