"""Copy primitives: the only thing a framework supplies to the execution of a plan.

A :class:`~gradsync.fusion.FusionPlan` says which copies pack tensors into a buffer and unpack the
results; :func:`gradsync.fusion.pack` and :func:`gradsync.fusion.unpack` carry them out, once for
every kind of memory, through a :class:`Memory`. :data:`HOST` is numpy's; a device tensor's is
:class:`DeviceMemory`, which enqueues the same copies through its framework's
:class:`~gradsync.device.DeviceRuntime` on the current CUDA stream.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import numpy as np


class Memory(Protocol):
    """Copies between tensors and 1-d buffer slices of one kind of memory."""

    def contiguous(self, array: Any) -> bool:
        """Whether ``array`` is C-contiguous and writable: a backend may reduce it in place."""

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

    def flat(self, array: np.ndarray) -> np.ndarray:
        return array.reshape(-1)

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

    runtime: Any  # a gradsync.device.DeviceRuntime
    device: int

    def contiguous(self, array: Any) -> bool:
        return self.runtime.is_contiguous(array)

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

