"""Fusion, the per-rank half: the plan of one response, built once, and pack/unpack over it.

Every response this rank executes becomes a :class:`FusionPlan` (:func:`make_plan`): its members, where
each lies in the buffer, the buffer's dtype, whether the lone tensor's own memory is the buffer,
the scale factors and the Average divisor. The rules live here once for host and device alike: the
lone-tensor rule (:func:`_in_place`), the Average rule (:func:`reduction`), the accumulator dtype
(:func:`gradsync.engine.fusion.buffer_dtype`), and pack/unpack (:func:`pack`, :func:`unpack`) over the
copy primitives of a :class:`~gradsync.executors.memory.Memory`. The executors only move the buffers.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import operator
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from ..arrays import dtypes
from ..engine.fusion import buffer_dtype
from ..engine.protocol import Kind, ReduceOp, Request, Response, split_rows
from .memory import Memory


@dataclasses.dataclass(frozen=True, eq=False)
class Traits:
    """What a backend reduces natively: the dtypes it reduces as they are (others are widened,
    :func:`gradsync.arrays.dtypes.accumulator`), the buffer dtypes whose Average it divides itself
    (NCCL's ncclAvg, which divides by the communicator's size), and whether its allreduce reads
    its data from a separate source buffer (the shared-memory path reads each rank's input where
    it lies): then a lone out-of-place allreduce is reduced from its input straight into its
    output, with no copy of the input first. Immutable, one per backend, hashed by identity (a
    key of the memoized plans, :func:`_allreduce_layout`, at the cost of a C call)."""

    native: frozenset[str] = dtypes.MPI_NATIVE
    averages: frozenset[str] = frozenset()
    reduces_from_source: bool = False


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
    """What this rank does for one response; built by :func:`make_plan`, run by an executor. Immutable
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
    entries: tuple[Any, ...]  # the members' request_queue.Entry objects, in the response's order
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
    from_source: bool = False  # a lone allreduce's backend reads the member's source, writes the buffer

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
        per-tensor coefficients (:func:`gradsync.executors.adasum.combine`)."""
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


def make_plan(response: Response, entries: list, context: Context) -> FusionPlan:
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


_REQUEST = operator.attrgetter("request")  # an entry's request, as one C call


def _offsets(counts: list[int]) -> list[int]:
    return list(itertools.accumulate(counts, initial=0))


@functools.lru_cache(maxsize=1024)
def _allreduce_layout(requests: tuple[Request, ...], divisor: int, size: int,
                      traits: Traits) -> tuple[np.dtype, Reduction, int, tuple[Copy, ...]]:
    """What an allreduce plan takes from its negotiated requests alone: the buffer's dtype, the
    reduction (:func:`reduction`), the element count and the members' copies. A pure function of
    its arguments, memoized: the steady state plans the same responses every step."""
    request = requests[0]
    dtype = buffer_dtype(request, traits.native)
    finish = reduction(request, dtype, divisor, size, traits)
    counts = [math.prod(r.shape) for r in requests]
    copies = tuple(map(Copy, range(len(counts)), _offsets(counts), counts))  # member, offset, count
    return dtype, finish, sum(counts), copies


def _allreduce(response: Response, entries: list, context: Context) -> FusionPlan:
    dtype, finish, count, copies = _allreduce_layout(tuple(map(_REQUEST, entries)), context.divisor,
                                                     context.size, context.traits)
    if not _in_place(entries, entries[0].target, dtype, context.memory):
        return FusionPlan(Kind.ALLREDUCE, tuple(entries), dtype, count, False, copies, copies,
                          reduction=finish)
    only = entries[0]
    separate = only.source is not only.target
    # The source-to-output rule, written once: an out-of-place lone allreduce without a prescale
    # is sent from its input and received in its output where the backend reads a source.
    from_source = (separate and finish.prescale == 1.0 and context.traits.reduces_from_source
                   and finish.send_op != ReduceOp.Adasum and context.memory.readable(only.source, dtype))
    packs = copies if separate and not from_source or finish.prescale != 1.0 else ()
    unpacks = copies if finish.scale != 1.0 or finish.floor_divisor != 1 else ()
    return FusionPlan(Kind.ALLREDUCE, (only,), dtype, count, True, packs, unpacks,
                      reduction=finish, from_source=from_source)


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
    copy, docs/performance-notes.md, fact 6). Where the buffer is the output itself only the scale remains."""
    finish = plan.reduction
    scale, floor_divisor = (finish.scale, finish.floor_divisor) if finish is not None else (1.0, 1)
    for copy in plan.unpacks:
        part = buffer[copy.offset:copy.offset + copy.count]
        if floor_divisor != 1:
            memory.floor_divide(part, floor_divisor)
        if scale != 1.0 or not plan.result_in_buffer:
            memory.copy(part, _rows(plan.entries[copy.member].target, copy.rows), scale)
