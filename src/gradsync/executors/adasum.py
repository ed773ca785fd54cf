"""Adasum: adaptive summation across ranks, as Horovod's ``op=hvd.Adasum`` on its CPU (MPI) path.

From Maleki et al., "Scaling Distributed Training with Adaptive Summation" (MLSys 2021). Two
vectors a and b combine into::

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

their sum when they are orthogonal, their average when they are parallel (a coefficient stays 1
when its vector's squared norm is below sqrt(DBL_MIN), as in Horovod). Over N = 2**k ranks the
combination is recursive and pairwise: at level j = 0 .. k-1 each rank exchanges its current
vector with rank ``r ^ 2**j`` and both replace theirs by the adaptive sum of the two, so after k
levels every rank holds the same result. The members of a fused buffer travel as one vector, but
each tensor gets its own coefficients (its own dot product and norms), as in Horovod's fused
buffers.

Where it runs, as Horovod places it: an Adasum allreduce is negotiated, fused and planned like
any allreduce (its op is part of the fusion key, so it fuses only with Adasum allreduces); the
host executor (:mod:`gradsync.executors.host`) then runs :func:`reduce` on the plan's float64
buffer instead of MPI_Allreduce, with the levels' exchanges as MPI_Sendrecv on the coordinator's
communicator. Arithmetic is float64 (the plan's buffer dtype, :func:`gradsync.engine.fusion.buffer_dtype`;
the prescale is folded into the pack), and the result is rounded once into the tensor's dtype in
the unpack; both partners compute each level from the same operands in the same order, so every
rank's result is bitwise equal. Horovod instead halves the vector at each level and sums the
partial dot products across the ranks holding the halves: the same formula, with k rather than
about 2 vectors of traffic per rank here, and Horovod rounds at every level in the tensor's dtype.

Which tensors may take ``op=Adasum`` (floating-point, host memory, a power-of-two number of
ranks, allreduce only) is checked once, at submission (:func:`check`).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence

import numpy as np

from ..arrays import dtypes

#: Adasum's arithmetic: the dtype of its buffer, whatever the tensors' dtype.
DTYPE = np.dtype(np.float64)
_TINY = math.sqrt(sys.float_info.min)  # below this squared norm a coefficient stays 1 (Horovod's rule)


def check(dtype: str, on_host: bool, size: int, where: str) -> None:
    """Refuse what Adasum cannot reduce: a ``dtype`` that is not floating-point, device memory
    (``on_host`` False), a process set of ``size`` ranks that is not a power of two (as Horovod's).

    Raises:
        TypeError: the dtype or the memory, naming the tensor by ``where``.
        NotImplementedError: the number of ranks.
    """
    if dtype not in dtypes.FLOATING:
        raise TypeError(f"{where}: op=Adasum needs a floating-point tensor "
                        f"({', '.join(sorted(dtypes.FLOATING))}), got {dtype}")
    if not on_host:
        raise TypeError(f"{where}: op=Adasum runs on host memory; copy the tensor to the host "
                        "(gradsync.torch does so itself)")
    check_ranks(size, where)


def check_ranks(size: int, where: str) -> None:
    """Refuse a process set of ``size`` ranks that is not a power of two (1, 2, 4, ...; Adasum's
    pairwise levels need one, as Horovod's), at submission and at an optimizer's construction.

    Raises:
        NotImplementedError: naming ``where`` and the size.
    """
    if size < 1 or size & (size - 1):
        raise NotImplementedError(f"{where}: op=Adasum needs a power-of-two number of ranks (as "
                                  f"Horovod's), but the process set has {size}")


def combine(a: np.ndarray, b: np.ndarray, bounds: Sequence[int]) -> np.ndarray:
    """The adaptive sum of the 1-d float64 vectors ``a`` and ``b``, segment by segment.

    Segment i is ``[bounds[i], bounds[i+1])`` (one tensor of a fused buffer); each gets its own
    coefficients from its own dot product and squared norms, summed in float64 by numpy's pairwise
    summation. Returns a new float64 vector of ``a``'s length. Pure function, the reference
    formula of this module.
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


def reduce(buffer: np.ndarray, received: np.ndarray, bounds: Sequence[int], rank: int, size: int,
           exchange: Callable[[np.ndarray, np.ndarray, int], None]) -> None:
    """Adasum of ``buffer`` (1-d float64, this rank's vector) over ``size`` ranks, in place.

    ``received``: a float64 scratch vector of ``buffer``'s length; ``bounds``: the members'
    segments (:func:`combine`); ``exchange(send, receive, partner)``: sends ``send`` to rank
    ``partner`` while receiving that rank's vector into ``receive`` (MPI_Sendrecv). ``size`` is a
    power of two (:func:`check`); at 1 rank the buffer is left as it is.
    """
    for level in range(size.bit_length() - 1):
        partner = rank ^ (1 << level)
        exchange(buffer, received, partner)
        low, high = (buffer, received) if rank < partner else (received, buffer)
        buffer[:] = combine(low, high, bounds)
