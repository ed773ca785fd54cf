"""Fusion: which ready allreduces share one buffer, and the plan of every response, built once.

Small tensors cost a fixed latency each; packing ready tensors of the same (dtype, op, scale factors)
into one fusion buffer pays that latency once (:func:`plan_allreduce`, on rank 0 or from the cache).
On the CPU the pack and unpack copies cost more than they save for large tensors (PERF-NOTES.md,
fact 4), so a tensor larger than the fusion threshold is reduced alone, in place in its own memory
when it is contiguous.

Every response this rank executes becomes a :class:`FusionPlan` (:func:`plan`): its members, where
each lies in the buffer, the buffer's dtype, whether the lone tensor's own memory is the buffer,
the scale factors and the Average divisor. The rules live here once for host and device alike: the
lone-tensor rule (:func:`_in_place`), the Average rule (:func:`reduction`), the accumulator dtype
(:func:`gradsync.dtypes.accumulator`), and pack/unpack (:func:`pack`, :func:`unpack`) over the copy
primitives of a :class:`~gradsync.memory.Memory`. The executors (:mod:`gradsync.executors`) only
move the buffers.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from . import adasum, dtypes
from .memory import Memory
from .protocol import FUSION_KEY, Kind, ReduceOp, Request, Response


def buffer_dtype(request: Request, native: frozenset[str] = dtypes.MPI_NATIVE) -> np.dtype:
    """The dtype in which a reduction of ``request`` runs, by a backend that reduces the dtypes in
    ``native`` as they are: Adasum's float64 (:data:`gradsync.adasum.DTYPE`), else the
    accumulator of :func:`gradsync.dtypes.accumulator`."""
    if request.op == ReduceOp.Adasum:
        return adasum.DTYPE
    return dtypes.accumulator(request.dtype, request.op == ReduceOp.Average, native)


def nbytes(request: Request) -> int:
    """Bytes the request occupies in a fusion buffer (its buffer dtype times its elements)."""
    return math.prod(request.shape) * buffer_dtype(request).itemsize


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
    sizes = sizes if sizes is not None else [nbytes(request) for request in ready]
    keys = list(map(FUSION_KEY, ready))
    if keys and keys.count(keys[0]) == len(keys):
        groups = _pack_one_key(ready, sizes, threshold)
    else:
        groups = _pack(ready, sizes, keys, threshold)
    if with_requests:
        return [Response(Kind.ALLREDUCE, tuple(map(_NAME, g)), requests=tuple(g)) for g in groups]
    return [Response(Kind.ALLREDUCE, tuple(map(_NAME, g))) for g in groups]


def _pack_one_key(ready: list[Request], sizes: list[int], threshold: int) -> list[list[Request]]:
    """:func:`_pack` when every request has the same fusion key (the usual case: one dtype): the
    same groups, without the per-key table (1000 requests per cycle, PERF-NOTES fact 7)."""
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



# ---------------------------------------------------------------------------------------------------
# The plan of one response


@dataclasses.dataclass(frozen=True)
class Traits:
    """What a backend reduces natively: the dtypes it reduces as they are (others are widened,
    :func:`gradsync.dtypes.accumulator`), and the buffer dtypes whose Average it divides itself
    (NCCL's ncclAvg, which divides by the communicator's size)."""

    native: frozenset[str] = dtypes.MPI_NATIVE
    averages: frozenset[str] = frozenset()


class Context(NamedTuple):
    """This rank's side of a plan: its rank and the set's size, the Average divisor of the
    response (the size, or the ranks that had not joined), the memory of its tensors and the
    backend's traits."""

    rank: int
    size: int
    divisor: int
    memory: Memory
    traits: Traits = Traits()


class Copy(NamedTuple):
    """One copy between a member's tensor and the buffer: elements ``offset`` .. ``offset + count``
    of the buffer, rows ``rows`` (start, stop) of the member's tensor (None: all of it)."""

    member: int
    offset: int
    count: int
    rows: tuple[int, int] | None = None


class Reduction(NamedTuple):
    """How a reduction runs and is finished (the Average rule, :func:`reduction`): the op sent to
    the backend (Average only where it divides itself), the prescale folded into the pack, the
    scale and the floor divisor (integer Average; 1: none) folded into the unpack, and whether the
    data is logical (bool as 0/1 uint8)."""

    send_op: ReduceOp
    prescale: float
    scale: float
    floor_divisor: int
    logical: bool

    @property
    def backend_divides(self) -> bool:
        """Whether the backend's op already divided an Average by the number of ranks."""
        return self.send_op == ReduceOp.Average


class FusionPlan(NamedTuple):
    """What this rank does for one response; built by :func:`plan`, run by an executor. Immutable
    named fields (a NamedTuple: one is built per response on the hot path, cheaper than a frozen
    dataclass).

    ``count`` elements of ``dtype`` are sent (the fusion buffer, or with ``in_place`` the lone
    tensor's own memory); ``packs`` fill the buffer from the members' sources, ``unpacks`` copy the
    results out (from the buffer, or from the receive buffer of reducescatter and allgather).
    ``counts[r]`` is per rank r: the elements it receives (reducescatter), contributes (allgather)
    or sends this rank (alltoall, with ``send_counts`` what this rank sends it, and ``rows`` the
    rows it receives from each rank). ``out_shapes``: the shapes of the results that the executor
    allocates (allgather, alltoall).
    """

    kind: Kind
    entries: tuple[Any, ...]  # the members' gradsync.queue.Entry objects, in the response's order
    dtype: np.dtype
    count: int
    in_place: bool
    packs: tuple[Copy, ...] = ()
    unpacks: tuple[Copy, ...] = ()
    counts: tuple[int, ...] = ()
    send_counts: tuple[int, ...] = ()
    out_shapes: tuple[tuple[int, ...], ...] = ()
    rows: tuple[int, ...] = ()
    reduction: Reduction | None = None
    root: int = -1

    @property
    def result_in_buffer(self) -> bool:
        """The buffer is the lone member's output itself (allreduce, broadcast in place)."""
        return self.in_place and self.kind in (Kind.ALLREDUCE, Kind.BROADCAST)

    @property
    def received_in_output(self) -> bool:
        """An allgather whose rows arrive straight in its lone member's output: the plan has
        nothing to unpack (:func:`_allgather` decides it, the executors follow)."""
        return self.kind == Kind.ALLGATHER and not self.unpacks

    @property
    def bounds(self) -> list[int]:
        """Where each member starts in the buffer, and the end: the segments of Adasum's
        per-tensor coefficients (:func:`gradsync.adasum.combine`)."""
        return _offsets([_elements(entry) for entry in self.entries])


def reduction(request: Request, buffer: np.dtype, divisor: int, size: int, traits: Traits) -> Reduction:
    """The Average rule, written once: a backend that averages ``buffer``'s dtype itself does so
    only when the divisor is the number of ranks (ncclAvg divides by the communicator's size);
    otherwise an Average is sent as Sum and divided in the unpack: floating results multiplied by
    postscale / divisor, integer results floor-divided (the floor of the exact mean)."""
    average = request.op == ReduceOp.Average
    native = average and divisor == size and buffer.name in traits.averages
    pending = divisor if average and not native else 1
    send_op = ReduceOp.Sum if average and not native else request.op
    if request.dtype in dtypes.INTEGER:
        return Reduction(send_op, request.prescale, request.postscale, pending, False)
    return Reduction(send_op, request.prescale, request.postscale / pending, 1, request.dtype == "bool")


def plan(response: Response, entries: list, context: Context) -> FusionPlan:
    """The plan of ``response`` on this rank, from its entries (in the order of ``response.names``;
    stand-ins where this rank joined). Same semantics on every rank: the layout depends only on the
    negotiated requests, never on this rank's data."""
    return _PLANNERS[response.kind](response, entries, context)


def _elements(entry: Any) -> int:
    return math.prod(entry.request.shape)


def _width(entry: Any) -> int:
    """Elements per row (dimension 0) of the entry's tensor."""
    return math.prod(entry.request.shape[1:])


def _in_place(entries: list, array: Any, dtype: np.dtype, memory: Memory) -> bool:
    """The lone-tensor rule, written once: a lone member whose dtype is the buffer's and whose
    memory is contiguous and writable is moved in its own memory, without a fusion copy."""
    return (len(entries) == 1 and dtypes.NUMPY_DTYPES[entries[0].request.dtype] == dtype
            and memory.contiguous(array))


def _offsets(counts: list[int]) -> list[int]:
    return list(itertools.accumulate(counts, initial=0))


def _allreduce(response: Response, entries: list, context: Context) -> FusionPlan:
    request = entries[0].request
    dtype = buffer_dtype(request, context.traits.native)
    finish = reduction(request, dtype, context.divisor, context.size, context.traits)
    counts = [_elements(e) for e in entries]
    copies = tuple(map(Copy, range(len(counts)), _offsets(counts), counts))  # member, offset, count
    if not _in_place(entries, entries[0].target, dtype, context.memory):
        return FusionPlan(Kind.ALLREDUCE, tuple(entries), dtype, sum(counts), False, copies, copies,
                          reduction=finish)
    only = entries[0]
    packs = copies if only.source is not only.target or finish.prescale != 1.0 else ()
    unpacks = copies if finish.scale != 1.0 or finish.floor_divisor != 1 else ()
    return FusionPlan(Kind.ALLREDUCE, (only,), dtype, counts[0], True, packs, unpacks,
                      reduction=finish)


def _reducescatter(response: Response, entries: list, context: Context) -> FusionPlan:
    """The send buffer holds, rank after rank, that rank's rows of each member in turn; each rank
    receives its rows of every member (MPI_Reduce_scatter's layout)."""
    request = entries[0].request
    dtype = buffer_dtype(request, context.traits.native)
    finish = reduction(request, dtype, context.divisor, context.size, context.traits)
    rows = [split_rows(e.request.shape[0], context.size) for e in entries]
    bounds = [_offsets(r) for r in rows]
    packs, position = [], 0
    for r in range(context.size):
        for i, entry in enumerate(entries):
            count = rows[i][r] * _width(entry)
            packs.append(Copy(i, position, count, (bounds[i][r], bounds[i][r + 1])))
            position += count
    counts = tuple(sum(rows[i][r] * _width(e) for i, e in enumerate(entries)) for r in range(context.size))
    mine = [rows[i][context.rank] * _width(e) for i, e in enumerate(entries)]
    unpacks = tuple(Copy(i, start, n) for i, (start, n) in enumerate(zip(_offsets(mine), mine)))
    in_place = finish.prescale == 1.0 and _in_place(entries, entries[0].source, dtype, context.memory)
    return FusionPlan(Kind.REDUCESCATTER, tuple(entries), dtype, position, in_place,
                      () if in_place else tuple(packs), unpacks, counts, reduction=finish)


def _broadcast(response: Response, entries: list, context: Context) -> FusionPlan:
    only = entries[0]
    dtype = dtypes.NUMPY_DTYPES[only.request.dtype]
    whole = (Copy(0, 0, _elements(only)),)
    root = only.request.root
    in_place = context.memory.contiguous(only.target)
    sends = context.rank == root and (not in_place or only.source is not only.target)
    return FusionPlan(Kind.BROADCAST, (only,), dtype, _elements(only), in_place,
                      whole if sends else (), () if in_place else whole, root=root)


def _allgather(response: Response, entries: list, context: Context) -> FusionPlan:
    """Every member's rows, packed member after member; what arrives holds, rank after rank, that
    rank's rows of each member in turn, unpacked into each member's output at that rank's rows."""
    dtype = dtypes.NUMPY_DTYPES[entries[0].request.dtype]
    dims = response.first_dims
    counts = tuple(sum(d[r] * _width(e) for d, e in zip(dims, entries)) for r in range(context.size))
    shapes = tuple((sum(d),) + tuple(e.request.shape[1:]) for d, e in zip(dims, entries))
    mine = [_elements(e) for e in entries]
    packs = tuple(Copy(i, start, n) for i, (start, n) in enumerate(zip(_offsets(mine), mine)))
    if len(entries) == 1:  # received straight into the output, sent from its own memory if it can
        in_place = context.memory.contiguous(entries[0].source)
        return FusionPlan(Kind.ALLGATHER, tuple(entries), dtype, mine[0], in_place,
                          () if in_place else packs, (), counts, out_shapes=shapes)
    unpacks, position = [], 0
    for r in range(context.size):
        for i, (d, entry) in enumerate(zip(dims, entries)):
            start = sum(d[:r])
            unpacks.append(Copy(i, position, d[r] * _width(entry), (start, start + d[r])))
            position += d[r] * _width(entry)
    return FusionPlan(Kind.ALLGATHER, tuple(entries), dtype, sum(mine), False, packs,
                      tuple(unpacks), counts, out_shapes=shapes)


def _alltoall(response: Response, entries: list, context: Context) -> FusionPlan:
    only = entries[0]
    width = _width(only)
    matrix = response.split_matrix
    rows = tuple(row[context.rank] for row in matrix)
    shape = (sum(rows),) + tuple(only.request.shape[1:])
    in_place = context.memory.contiguous(only.source)
    whole = (Copy(0, 0, _elements(only)),)
    return FusionPlan(Kind.ALLTOALL, (only,), dtypes.NUMPY_DTYPES[only.request.dtype], _elements(only),
                      in_place, () if in_place else whole, (), tuple(n * width for n in rows),
                      tuple(n * width for n in matrix[context.rank]), (shape,), rows)


def _control(response: Response, entries: list, context: Context) -> FusionPlan:
    """Barrier and join move no data: the response itself proves every rank arrived."""
    return FusionPlan(response.kind, tuple(entries), np.dtype(np.uint8), 0, True)


_PLANNERS: dict[Kind, Callable[[Response, list, Context], FusionPlan]] = {
    Kind.ALLREDUCE: _allreduce, Kind.REDUCESCATTER: _reducescatter, Kind.BROADCAST: _broadcast,
    Kind.ALLGATHER: _allgather, Kind.ALLTOALL: _alltoall, Kind.BARRIER: _control, Kind.JOIN: _control,
}


def _rows(array: Any, rows: tuple[int, int] | None) -> Any:
    return array if rows is None else array[rows[0]:rows[1]]


def pack(plan: FusionPlan, memory: Memory, buffer: Any) -> None:
    """Copy every member's data into its place in ``buffer`` (the prescale folded into the copy)."""
    scale = plan.reduction.prescale if plan.reduction is not None else 1.0
    for copy in plan.packs:
        source = _rows(plan.entries[copy.member].source, copy.rows)
        memory.copy(source, buffer[copy.offset:copy.offset + copy.count], scale)


def unpack(plan: FusionPlan, memory: Memory, buffer: Any) -> None:
    """Copy the results from ``buffer`` into the members' outputs, finishing the reduction: an
    integer Average floor-divided, floating results scaled (postscale and divisor folded into the
    copy, PERF-NOTES.md fact 6). Where the buffer is the output itself only the scale remains."""
    finish = plan.reduction
    scale, floor_divisor = (finish.scale, finish.floor_divisor) if finish is not None else (1.0, 1)
    for copy in plan.unpacks:
        part = buffer[copy.offset:copy.offset + copy.count]
        if floor_divisor != 1:
            memory.floor_divide(part, floor_divisor)
        if scale != 1.0 or not plan.result_in_buffer:
            memory.copy(part, _rows(plan.entries[copy.member].target, copy.rows), scale)
