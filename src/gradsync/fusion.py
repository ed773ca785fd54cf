"""Fusion: planning which ready allreduces share one buffer, and packing them into it.

Small tensors cost a fixed latency each; packing ready tensors of the same (dtype, op, scale factors)
into one fusion buffer pays that latency once. On the CPU the pack and unpack copies cost more than
they save for large tensors (PERF-NOTES.md, fact 4), so a tensor larger than the fusion threshold is
reduced alone, in place in its own memory when it is contiguous.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from . import dtypes
from .protocol import Kind, ReduceOp, Request, Response


def nbytes(request: Request) -> int:
    """Bytes the request occupies in a fusion buffer (its accumulator dtype times its elements)."""
    acc = dtypes.accumulator(request.dtype, request.op == ReduceOp.Average)
    return math.prod(request.shape) * acc.itemsize


def split_rows(rows: int, size: int) -> list[int]:
    """How reducescatter splits ``rows`` (dimension 0) over ``size`` ranks: as evenly as possible,
    the first ``rows % size`` ranks getting one row more (rank r gets rows // size + (r < rows % size)),
    in rank order, as MPI_Reduce_scatter with those counts."""
    base, extra = divmod(rows, size)
    return [base + (r < extra) for r in range(size)]


def plan_allreduce(ready: list[Request], threshold: int, sizes: list[int] | None = None,
                   with_requests: bool = False) -> list[Response]:
    """Group ready allreduce requests into fused responses.

    Requests with the same (dtype, op, prescale, postscale, device) are packed in order into responses of at
    most ``threshold`` bytes; a request larger than ``threshold`` gets a response of its own. The
    order of responses is the order of their first request, so every rank that runs the same plan
    moves the same bytes in the same order. ``sizes``: each request's :func:`nbytes`, if known
    (the response cache keeps them); ``with_requests``: fill ``Response.requests``.
    """
    groups: list[list[Request]] = []
    open_group: dict[tuple, list] = {}  # fusion key -> [group, bytes so far]
    for position, request in enumerate(ready):
        size = sizes[position] if sizes is not None else nbytes(request)
        if size > threshold:
            groups.append([request])
            continue
        key = request.fusion_key()
        current = open_group.get(key)
        if current is not None and current[1] + size <= threshold:
            current[0].append(request)
            current[1] += size
        else:
            group = [request]
            groups.append(group)
            open_group[key] = [group, size]
    if with_requests:
        return [Response(Kind.ALLREDUCE, tuple(r.name for r in g), requests=tuple(g)) for g in groups]
    return [Response(Kind.ALLREDUCE, tuple(r.name for r in g)) for g in groups]


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

    def clear(self) -> None:
        """Drop every buffer (they are freed once no one else holds them)."""
        self._buffers.clear()


def pack(source: np.ndarray, target: np.ndarray, prescale: float) -> None:
    """Copy ``source`` (any strides, any dtype) into the flat ``target`` slice, times ``prescale``."""
    target = target.reshape(source.shape)
    if prescale == 1.0:
        np.copyto(target, source, casting="unsafe")
    else:
        # In the buffer's (accumulator's) precision: float16/bfloat16 inputs are scaled in float32,
        # so the result is rounded to the tensor's dtype only once, after the reduction.
        np.multiply(source, prescale, out=target, dtype=target.dtype, casting="unsafe")


def unpack(source: np.ndarray, target: np.ndarray, scale: float, floor_divisor: int) -> None:
    """Copy the flat ``source`` slice into ``target`` (any strides), finishing the reduction.

    Floating results are multiplied by ``scale``; integer averages are floor-divided by
    ``floor_divisor`` (1 means no division). Casting to ``target``'s dtype rounds to nearest.
    """
    in_place = source is target
    source = source.reshape(target.shape)
    if floor_divisor != 1:
        np.floor_divide(source, floor_divisor, out=source)
    if scale == 1.0 and in_place:
        return
    if scale == 1.0:
        np.copyto(target, source, casting="unsafe")
    else:
        np.multiply(source, scale, out=target, casting="unsafe")
