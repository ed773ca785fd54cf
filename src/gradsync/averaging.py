"""How a DistributedOptimizer's gradients are averaged: the two rules every framework adapter shares
(torch, tensorflow, keras), written once here.

**The Average divisor is the core's.** An adapter asks the core for ``op=Average`` and never divides
by the process set's size itself: the coordinator decides the divisor once per collective (the
set's size, or with ``GRADSYNC_JOIN_DIVISOR=contributors`` the ranks that have not joined;
:meth:`gradsync.engine.execution.ResponseExecution.divisor`), applies it, and hands it on as
:attr:`gradsync.Handle.divisor` to a layer that finishes an Average itself (the allgather of sparse
gradients).

**gradient_predivide_factor** (Horovod's) is a split of that division around the sum: with a factor
``f`` each rank's gradient is multiplied by ``1/f`` before the sum (to keep a low-precision sum in
range) and the sum by ``f / divisor`` after it, the same average with other rounding.
:func:`predivide_scales` maps it onto the core's Average as (prescale, postscale) = ``(1/f, f)``:
the core divides by its own divisor after the postscale.
"""

from __future__ import annotations

from .engine.protocol import ReduceOp
from .process_sets import ProcessSet


def predivide_scales(op: ReduceOp, factor: float, where: str) -> tuple[float, float]:
    """(prescale, postscale) of ``gradient_predivide_factor=factor`` for gradients reduced with
    ``op``: ``(1/factor, factor)`` for ``Average`` (the core divides by its divisor), ``(1, 1)``
    for a factor of 1.

    Raises:
        ValueError: a factor other than 1 with an op other than Average (the message starts with
            ``where``, the caller's name and rank).
    """
    factor = float(factor)
    if factor == 1.0:
        return 1.0, 1.0
    if ReduceOp(op) != ReduceOp.Average:
        raise ValueError(f"{where}: gradient_predivide_factor={factor} needs op=Average, "
                         f"not {ReduceOp(op).name}")
    return 1.0 / factor, factor


def local_gradient_divisor(process_set: ProcessSet) -> int:
    """What a gradient kept local is divided by (Horovod's ``scale_local_gradients``: the layers of
    a ``PartialDistributedGradientTape`` or ``PartialDistributedOptimizer``): the size of the set,
    as Horovod's. No collective runs for it, so there is no core divisor to take: it matches the
    learning rate scaled by the number of ranks that the reduced gradients are averaged over."""
    return process_set.size()
