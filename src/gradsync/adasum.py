"""Adasum: adaptive summation across ranks, as Horovod's ``op=hvd.Adasum`` on its CPU (MPI) path.

From Maleki et al., "Scaling Distributed Training with Adaptive Summation" (MLSys 2021). Two
vectors a and b combine into::

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

their sum when they are orthogonal, their average when they are parallel (a coefficient stays 1
when its vector's squared norm is below sqrt(DBL_MIN), as in Horovod). Over N = 2**k ranks the
combination is recursive and pairwise: at level j = 0 .. k-1 each rank exchanges its current
vector with rank ``r ^ 2**j`` and both replace theirs by the adaptive sum of the two, so after k
levels every rank holds the same result. The members of a group travel as one vector, but each
tensor gets its own coefficients (its own dot product and norms), as in Horovod's fused buffers.

Each level's exchange is a gradsync alltoall that sends the whole vector to the partner and nothing
to the other ranks: negotiated and ordered by the coordinator like any collective, so Adasum mixes
freely with the other ops and with process sets. The levels after the first run in a helper thread
per call, so the ``*_async`` forms return at once. Arithmetic is float64 (the inputs are converted
once, after the prescale), and the result is rounded once into the tensor's dtype; both partners
compute each level from the same operands in the same order, so every rank's result is bitwise
equal. Horovod instead halves the vector at each level and sums the partial dot products across
the ranks holding the halves: the same formula, with k rather than about 2 vectors of traffic per
rank here, and Horovod rounds at every level in the tensor's own dtype.
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import ops, runtime
from .arrays import adapter_for
from .device import device_kind
from .errors import CollectiveError
from .handles import GroupHandle, Handle
from .process_sets import ProcessSet

FLOATING = ("float16", "bfloat16", "float32", "float64")
_TINY = math.sqrt(sys.float_info.min)  # below this squared norm a coefficient stays 1 (Horovod's rule)


def combine(a: np.ndarray, b: np.ndarray, bounds: Sequence[int]) -> np.ndarray:
    """The adaptive sum of the 1-d float64 vectors ``a`` and ``b``, segment by segment.

    Segment i is ``[bounds[i], bounds[i+1])`` (one tensor of a group); each gets its own
    coefficients from its own dot product and squared norms, summed in float64 by numpy's pairwise
    summation. Returns a new
    float64 vector of ``a``'s length. Pure function, the reference formula of this module.
    """
    out = np.empty_like(a)
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        x, y = a[lo:hi], b[lo:hi]
        # numpy's own pairwise sums, not BLAS: the same bits in every process whatever its BLAS
        # threads (both partners must compute the same result), and no thread pool to oversubscribe
        dot, xx, yy = float(np.sum(x * y)), float(np.sum(x * x)), float(np.sum(y * y))
        ca = 1.0 - 0.5 * dot / xx if xx >= _TINY else 1.0
        cb = 1.0 - 0.5 * dot / yy if yy >= _TINY else 1.0
        np.add(ca * x, cb * y, out=out[lo:hi])
    return out


class _Member:
    """One tensor of an Adasum call: its dtype, shape, the view written at the end, the result."""

    def __init__(self, tensor: Any, name: str | None, in_place: bool, where: str) -> None:
        adapter = adapter_for(tensor, name)
        info = adapter.info(tensor)
        if info.dtype not in FLOATING:
            raise TypeError(f"{where}: op=Adasum needs a floating-point tensor ({', '.join(FLOATING)}), "
                            f"got {info.dtype}")
        if device_kind(info.device) != "cpu":
            raise TypeError(f"{where}: op=Adasum runs on host memory, but the tensor is on "
                            f"{info.device}; copy it to the host (gradsync.torch does so itself)")
        self.shape = info.shape
        self.source = adapter.host_view(tensor)
        if in_place:
            if not self.source.flags.writeable:
                raise ValueError(f"{where}: in-place operation on a read-only array")
            self.result, self.target = tensor, self.source
        else:
            self.result = adapter.empty(tensor, info.shape)
            self.target = adapter.host_view(self.result)


class _Call:
    """The state of one Adasum allreduce: the vector (with a trailing flag), its segments, the
    handles; the levels run in :meth:`run` (a helper thread)."""

    def __init__(self, name: str, members: list[_Member], handles: list[Handle], prescale: float,
                 postscale: float, rank: int, size: int, process_set: ProcessSet) -> None:
        self.name, self.members, self.handles = name, members, handles
        self.postscale = postscale
        self.rank, self.size, self.process_set = rank, size, process_set
        sizes = [int(np.prod(m.shape, dtype=np.int64)) for m in members]
        self.bounds = np.concatenate(([0], np.cumsum(sizes))).astype(int).tolist()
        # The last element is a flag, 1 once some rank of this rank's partners had joined.
        self.vector = np.zeros(self.bounds[-1] + 1, np.float64)
        for member, lo, hi in zip(members, self.bounds, self.bounds[1:]):
            np.multiply(member.source.reshape(-1), prescale, out=self.vector[lo:hi], casting="unsafe")

    @property
    def levels(self) -> int:
        return self.size.bit_length() - 1

    def exchange(self, level: int) -> Handle:
        """Start level ``level``: the whole vector to partner ``rank ^ 2**level``, nothing to others."""
        splits = [0] * self.size
        splits[self.rank ^ (1 << level)] = self.vector.size
        return ops.alltoall_async(self.vector, splits, name=f"{self.name}.adasum.{level}",
                                  process_set=self.process_set)

    def step(self, level: int, received: np.ndarray) -> None:
        """Combine this rank's vector with its partner's; a partner that sent nothing had joined."""
        if received.size != self.vector.size:
            self.vector[-1] = 1.0
            return
        partner = self.rank ^ (1 << level)
        low, high = (self.vector, received) if self.rank < partner else (received, self.vector)
        flag = max(self.vector[-1], received[-1])
        self.vector = combine(low, high, self.bounds)  # the flag slot is set below
        self.vector[-1] = flag

    def finish(self) -> None:
        """Write every member's result (postscale folded in) and complete the handles."""
        if self.vector[-1]:
            raise CollectiveError(
                f"gradsync: rank {runtime.get().rank}: allreduce {self.name!r}: op=Adasum cannot run "
                "while some ranks have called join() (their vectors are missing)")
        for member, lo, hi in zip(self.members, self.bounds, self.bounds[1:]):
            values = self.vector[lo:hi].reshape(member.shape)
            if self.postscale != 1.0:
                values = values * self.postscale
            np.copyto(member.target, values, casting="unsafe")
        for member, handle in zip(self.members, self.handles):
            handle._set_result(member.result)

    def run(self, first: Handle) -> None:
        try:
            pending = first
            for level in range(self.levels):
                received, _ = ops.synchronize(pending)
                self.step(level, received)
                if level + 1 < self.levels:
                    pending = self.exchange(level + 1)
            self.finish()
        except BaseException as exc:  # the handles carry every failure, the thread never dies silently
            for handle in self.handles:
                handle._set_error(exc)


def allreduce_async(tensors: Sequence[Any], name: str | None, in_place: bool, prescale_factor: float,
                    postscale_factor: float, process_set: ProcessSet,
                    grouped: bool) -> Handle | GroupHandle:
    """Start an Adasum allreduce of ``tensors`` (one, or a group travelling as one vector).

    Called by :func:`gradsync.allreduce_async` and the grouped forms for ``op=Adasum``; same
    arguments, plus ``grouped`` (return a GroupHandle whose members are named ``name.0`` ...).

    Raises:
        NotImplementedError: the process set's size is not a power of two (as Horovod's).
        TypeError: a tensor that is not floating-point, or not in host memory.
        ValueError: in place on a read-only array; a name still in flight; the process set is not
            registered or lacks this rank.
        CollectiveError (from the handle): some rank had joined; ranks disagreed on the sizes.
    """
    rt = runtime.get()
    label = "(unnamed)" if name is None else repr(str(name))
    what = "grouped_allreduce" if grouped else "allreduce of tensor"
    where = f"gradsync: rank {rt.rank}: {what} {label}"
    coordinator = rt.coordinator_for(process_set, where)
    size = coordinator.size
    if size & (size - 1):
        raise NotImplementedError(f"{where}: op=Adasum needs a power-of-two number of ranks (as "
                                  f"Horovod's), but the process set has {size}")
    members = [_Member(t, name, in_place, f"{where}, member {i}" if grouped else where)
               for i, t in enumerate(tensors)]
    name = ops._name(coordinator, name, "grouped_allreduce" if grouped else "allreduce")
    handles = [Handle(f"{name}.{i}") for i in range(len(members))] if grouped else [Handle(name)]
    call = _Call(name, members, handles, float(prescale_factor), float(postscale_factor),
                 coordinator.rank, size, process_set)
    if size == 1:
        call.finish()
    else:
        first = call.exchange(0)  # in this thread: a name still in flight fails the call itself
        threading.Thread(target=call.run, args=(first,), name="gradsync-adasum", daemon=True).start()
    return GroupHandle(name, handles) if grouped else handles[0]
