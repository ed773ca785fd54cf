"""Join stand-ins: what a rank that called :func:`gradsync.join` contributes to the collectives
the other ranks still run (same semantics as Horovod's join)."""

from __future__ import annotations

import numpy as np

from . import dtypes
from .fusion import split_rows
from .handles import Handle
from .protocol import Kind, ReduceOp, Request
from .queue import Entry

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
