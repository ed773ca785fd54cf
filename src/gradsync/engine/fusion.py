"""Fusion, the negotiation half: which ready allreduces share one fusion buffer.

Small tensors cost a fixed latency each; packing ready tensors of the same (dtype, op, scale factors)
into one fusion buffer pays that latency once (:func:`plan_allreduce`, on rank 0 or from the response
cache). On the CPU the pack and unpack copies cost more than they save for large tensors
(docs/performance-notes.md, fact 4), so a tensor larger than the fusion threshold gets a response of
its own. How each rank then lays the members out in the buffer is the other half,
:mod:`gradsync.executors.plan`.
"""

from __future__ import annotations

import functools
import math
import operator

import numpy as np

from ..arrays import dtypes
from ..executors import adasum
from .protocol import FUSION_KEY, Kind, ReduceOp, Request, Response


def buffer_dtype(request: Request, native: frozenset[str] = dtypes.MPI_NATIVE) -> np.dtype:
    """The dtype in which a reduction of ``request`` runs, by a backend that reduces the dtypes in
    ``native`` as they are: Adasum's float64 (:data:`gradsync.executors.adasum.DTYPE`), else the
    accumulator of :func:`gradsync.arrays.dtypes.accumulator`."""
    if request.op == ReduceOp.Adasum:
        return adasum.DTYPE
    return dtypes.accumulator(request.dtype, request.op == ReduceOp.Average, native)


@functools.lru_cache(maxsize=4096)
def nbytes(request: Request) -> int:
    """Bytes the request occupies in a fusion buffer (its buffer dtype times its elements).
    Memoized: a pure function of the request, asked for every cycle of a caller's turn."""
    return math.prod(request.shape) * buffer_dtype(request).itemsize


def plan_allreduce(ready: list[Request], threshold: int, sizes: list[int] | None = None,
                   with_requests: bool = False) -> list[Response]:
    """Group ready allreduce requests into fused responses.

    Requests with the same (dtype, op, prescale, postscale, device) are packed in order into responses of at
    most ``threshold`` bytes; a request larger than ``threshold`` gets a response of its own. The
    order of responses is the order of their first request, so every rank that runs the same plan
    moves the same bytes in the same order. ``sizes``: each request's :func:`nbytes`, if known
    (the response cache keeps them); ``with_requests``: fill ``Response.requests``.
    """
    sizes = sizes if sizes is not None else [nbytes(request) for request in ready]
    keys = list(map(FUSION_KEY, ready)) if len(ready) > 1 else []
    if not keys:  # none, or one: alone whatever its size (a blocking op's cycle)
        groups = [ready] if ready else []
    elif keys.count(keys[0]) == len(keys):
        groups = _pack_one_key(ready, sizes, threshold)
    else:
        groups = _pack(ready, sizes, keys, threshold)
    if with_requests:
        return [Response(Kind.ALLREDUCE, tuple(map(_NAME, g)), requests=tuple(g)) for g in groups]
    return [Response(Kind.ALLREDUCE, tuple(map(_NAME, g))) for g in groups]


def _pack_one_key(ready: list[Request], sizes: list[int], threshold: int) -> list[list[Request]]:
    """:func:`_pack` when every request has the same fusion key (the usual case: one dtype): the
    same groups, without the per-key table (1000 requests per cycle, docs/performance-notes.md, fact 7)."""
    groups: list[list[Request]] = []
    group: list[Request] = []
    total = 0
    for request, size in zip(ready, sizes):
        if size > threshold:
            groups.append([request])
        elif group and total + size <= threshold:
            group.append(request)
            total += size
        else:
            group = [request]
            groups.append(group)
            total = size
    return groups


def _pack(ready: list[Request], sizes: list[int], keys: list[tuple], threshold: int) -> list[list[Request]]:
    """The groups of :func:`plan_allreduce`, in the order of their first request."""
    groups: list[list[Request]] = []
    open_group: dict[tuple, list] = {}  # fusion key -> [group, bytes so far]
    for request, size, key in zip(ready, sizes, keys):
        if size > threshold:
            groups.append([request])
            continue
        current = open_group.get(key)
        if current is not None and current[1] + size <= threshold:
            current[0].append(request)
            current[1] += size
        else:
            group = [request]
            groups.append(group)
            open_group[key] = [group, size]
    return groups


_NAME = operator.attrgetter("name")
