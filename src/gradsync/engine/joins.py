"""The join rules: what a rank that called :func:`gradsync.join` contributes to the collectives
the other ranks still run (same semantics as Horovod's join), and, for negotiation (the full and
the cached path alike, :mod:`gradsync.engine.negotiation`), which collectives cannot run beside a joined
rank and how many ranks contribute to the others."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from ..arrays import dtypes
from ..handles import Handle
from .protocol import Kind, ReduceOp, Request, Response, split_rows
from .request_queue import Entry

# The identity of each reduction: what a joined rank adds without changing the result.
_IDENTITY = {ReduceOp.Average: "zero", ReduceOp.Sum: "zero", ReduceOp.Product: "one",
             ReduceOp.Min: "max", ReduceOp.Max: "min"}


def stand_in(request: Request, rank: int, size: int) -> Entry:
    """A joined rank's contribution (in host memory) to ``request``, a collective it did not submit.

    For allreduce and reducescatter the identity of the op: zeros for Sum/Average, ones for
    Product, the dtype's largest value for Min and smallest for Max (a reducescatter's rows for this
    rank are discarded); for allgather and alltoall no rows (what alltoall sends it is discarded);
    for broadcast a buffer to receive into. ``rank``/``size``: this rank's place in the set.
    """
    dtype = dtypes.NUMPY_DTYPES[request.dtype]
    shape = request.shape
    if request.kind in (Kind.ALLGATHER, Kind.ALLTOALL):
        empty = np.empty((0,) + tuple(shape[1:]), dtype)

        def allocate(full_shape, *_):
            out = np.empty(full_shape, dtype)
            return out, out

        return Entry(request, Handle(request.name), empty, None, None, allocate)
    data = np.zeros(shape, dtype)
    target = data
    if request.kind == Kind.REDUCESCATTER:
        rows = split_rows(shape[0], size)[rank]
        target = np.empty((rows,) + tuple(shape[1:]), dtype)
    if request.kind in (Kind.ALLREDUCE, Kind.REDUCESCATTER):
        _fill_identity(data, request)
    return Entry(request, Handle(request.name), data, target, None)


def _fill_identity(data: np.ndarray, request: Request) -> None:
    identity = _IDENTITY[request.op]
    if identity == "one":
        data[...] = 1
    elif identity != "zero":
        if request.dtype in dtypes.FLOATING:
            data[...] = np.inf if identity == "max" else -np.inf
        else:
            info = np.iinfo(np.uint8 if request.dtype == "bool" else data.dtype)
            data[...] = info.max if identity == "max" else info.min


def refusal(request: Request, names: tuple[str, ...], world: tuple[int, ...],
                  ranks: Iterable[int]) -> Response | None:
    """While ``ranks`` of the set (``world[r]`` in the world's numbering, which the error gives)
    have joined: the error response of a collective (alone, or a whole group) that cannot run
    beside a joined rank, or None if it runs with the joined ranks' stand-ins. Refused: what the
    Horovod namespace marks ``refuse_join`` (Horovod's semantics), and Adasum, whose pairwise
    levels need every rank's vector (a stand-in of zeros would change the result)."""
    if not ranks:
        return None
    adasum = request.kind == Kind.ALLREDUCE and request.op == ReduceOp.Adasum
    if not (request.refuse_join or adasum):
        return None
    joined = sorted(world[r] for r in ranks)
    kind = request.kind.name.lower()
    what = f"{kind} {request.name!r}"
    if request.group:
        what = f"grouped {kind} {request.group!r} fails as a whole"
    listed = f"rank{'s' if len(joined) > 1 else ''} {', '.join(map(str, joined))} called join()"
    if adasum:
        return Response(request.kind, names, error=(
            f"{what}: {listed}; op=Adasum cannot run while some ranks have joined (their vectors "
            "are missing)"))
    return Response(request.kind, names, error=(
        f"{what}: {listed}; Horovod's {kind} does not run beside a joined rank (gradsync.{kind} "
        "does: the joined rank takes part with a stand-in)"))


def counting_contributors(responses: list[Response], size: int,
                           joined: Iterable[int]) -> list[Response]:
    """While ``joined`` ranks (of ``size``) have joined, every response but join's carries the
    number of ranks that contribute (from which the coordinator takes the Average divisor of
    ``GRADSYNC_JOIN_DIVISOR=contributors``); its ``requests`` are what the joined ranks stand in
    for."""
    count = len(set(joined))
    if not count:
        return responses
    return [r if r.kind == Kind.JOIN else r._replace(contributors=size - count) for r in responses]
