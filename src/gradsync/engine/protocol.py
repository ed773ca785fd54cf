"""The messages of negotiation: what a rank asks for (Request) and what all ranks agree to do (Response).

Both are small immutable tuples so that they pickle quickly; they are what crosses the coordinator's
communicator every cycle.
"""

from __future__ import annotations

import enum
import operator
from types import MappingProxyType
from typing import NamedTuple


class ReduceOp(enum.IntEnum):
    """Reduction operations of allreduce (same semantics as the MPI operations of the same name).

    ``Average`` is ``Sum`` divided by the number of ranks; for integer tensors it is the floor of the
    exact mean (see :mod:`gradsync.arrays.dtypes`). ``Adasum`` is the adaptive summation of Maleki et al.
    (MLSys 2021), as Horovod's ``op=hvd.Adasum``: allreduce and grouped allreduce of floating-point
    host tensors on a power-of-two number of ranks (see :mod:`gradsync.executors.adasum`).
    """

    Average = 0
    Sum = 1
    Min = 2
    Max = 3
    Product = 4
    Adasum = 5


#: The op that computes ``op`` on bool data, which travels as 0/1 uint8 (:mod:`gradsync.arrays.dtypes`):
#: Sum and Max are logical or (max), Min and Product logical and (min). Average is not defined for
#: bool (refused at submission). Every backend's bool reduction reads it here.
LOGICAL_OPS = MappingProxyType({
    ReduceOp.Sum: ReduceOp.Max,
    ReduceOp.Max: ReduceOp.Max,
    ReduceOp.Min: ReduceOp.Min,
    ReduceOp.Product: ReduceOp.Min,
})


Average = ReduceOp.Average
Sum = ReduceOp.Sum
Min = ReduceOp.Min
Max = ReduceOp.Max
Product = ReduceOp.Product
Adasum = ReduceOp.Adasum


class Kind(enum.IntEnum):
    """Which collective a request asks for."""

    ALLREDUCE = 0
    BROADCAST = 1
    ALLGATHER = 2
    BARRIER = 3
    JOIN = 4
    ALLTOALL = 5
    REDUCESCATTER = 6


#: Each kind's name in lower case, as messages and automatic names spell it: a dict lookup where
#: ``kind.name.lower()`` costs two Python calls (enum's ``name`` is a Python property), on every op.
KIND_NAMES = MappingProxyType({kind: kind.name.lower() for kind in Kind})


class Request(NamedTuple):
    """One rank's description of a collective it wants to run.

    All ranks must send requests with the same ``name``; they must agree on every other field except
    ``rank`` (and, for allgather and alltoall, the first dimension of ``shape``, and ``splits``).

    ``splits`` (alltoall): the rows this rank sends to each rank. ``group``: the name of the group
    this request belongs to (grouped ops; empty otherwise), which has ``group_size`` members, all
    negotiated and executed as one unit.
    ``device`` is the kind of memory the tensor lives in, ``"cpu"`` or ``"cuda"`` (not the device
    index: each rank uses its own GPU), so host and device tensors are never fused together.
    ``refuse_join``: fail it on every rank while some rank has called join(), as Horovod does for
    allgather, broadcast, alltoall and reducescatter (set by the Horovod namespace,
    ``gradsync.torch``); otherwise a joined rank takes part with a stand-in.
    """

    name: str
    kind: Kind
    rank: int
    dtype: str
    shape: tuple[int, ...]
    op: ReduceOp = ReduceOp.Average
    root: int = -1
    prescale: float = 1.0
    postscale: float = 1.0
    splits: tuple[int, ...] = ()
    group: str = ""
    group_size: int = 0
    device: str = "cpu"
    refuse_join: bool = False

    def signature(self) -> tuple:
        """Every field but ``rank``: what the ranks' requests for one name must share (the
        response cache's hit test, the common case of the agreement check)."""
        return self[:2] + self[3:]  # the one place that knows ``rank`` is the third field

    def fusion_key(self) -> tuple:
        """What allreduces fused into one buffer must share: dtype, op, scale factors, device."""
        return FUSION_KEY(self)

    def queued_as(self, name: str, group: str, group_size: int, refuse_join: bool) -> Request:
        """This request under ``name``, in ``group`` of ``group_size`` (or none: ``""``, 0), with
        ``refuse_join``: ``_replace`` of those fields, at a fraction of its cost (once per op)."""
        return tuple.__new__(Request, (name,) + self[1:10] + (group, group_size, self[12], refuse_join))


assert Request._fields[10:] == ("group", "group_size", "device", "refuse_join")  # queued_as's slices

#: :meth:`Request.fusion_key` as one C call (the cached cycle computes it for every ready allreduce).
FUSION_KEY = operator.attrgetter("dtype", "op", "prescale", "postscale", "device")

#: A request's group name ("" outside a group) as one C call: ``any(map(GROUP, requests))`` tells
#: whether a cycle's requests hold a group member (negotiation, rank 0's message table).
GROUP = operator.attrgetter("group")


class Response(NamedTuple):
    """What every rank does next, in the same order on every rank.

    ``names`` holds one tensor, or several fused into one buffer (allreduce, and the members of a
    group). ``error`` set means the collective fails on every rank with that message (a rank skips
    names it did not submit). ``first_dims`` is, for allgather, one tuple per name: the first
    dimension each rank contributes (index = rank). ``last_joined`` (join): the rank that joined
    last. ``split_matrix`` (alltoall):
    row s holds the rows rank s sends to each rank, so column r is what rank r receives.
    While some ranks have joined (:func:`gradsync.join`), ``requests`` carries the request behind
    each name, from which a joined rank builds its stand-in contribution, and ``contributors``
    the number of ranks that submitted (0: all of them).
    """

    kind: Kind
    names: tuple[str, ...]
    error: str | None = None
    first_dims: tuple[tuple[int, ...], ...] = ()
    requests: tuple[Request, ...] = ()
    contributors: int = 0
    split_matrix: tuple[tuple[int, ...], ...] = ()
    last_joined: int = -1


class RankMessage(NamedTuple):
    """What one rank sends rank 0 in a full negotiation cycle.

    ``stall``: this rank asks for a stall report; ``pending``: when sent, every collective this rank
    is waiting for, as (name, seconds waited, None), and those it waits for on its other process
    sets, as (name, 0.0, process set id).
    """

    shutdown: bool
    requests: list[Request]
    stall: bool = False
    pending: tuple[tuple[str, float, int | None], ...] | None = None


class CycleReply(NamedTuple):
    """Rank 0's answer to one negotiation cycle: the responses, which ranks asked to shut down, and
    (from autotune) the (fusion threshold, cycle time) every rank uses from the next cycle on, and a
    stall report with which every rank shuts down."""

    responses: tuple[Response, ...]
    shutdown_ranks: tuple[int, ...] = ()
    settings: tuple[int, float] | None = None
    stall_error: str | None = None
    joined: tuple[int, ...] | None = None  # the ranks joined from now on, when that changed


def split_rows(rows: int, size: int) -> list[int]:
    """How reducescatter splits ``rows`` (dimension 0) over ``size`` ranks: as evenly as possible,
    the first ``rows % size`` ranks getting one row more (rank r gets rows // size + (r < rows % size)),
    in rank order, as MPI_Reduce_scatter with those counts."""
    base, extra = divmod(rows, size)
    return [base + (r < extra) for r in range(size)]
