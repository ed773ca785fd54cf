"""The JAX backend of gradsync.keras: gradients are jax arrays, traced inside the jitted train step.

They are averaged as :func:`gradsync.jax.DistributedOptimizer` averages an optax update's:
:func:`gradsync.jax.allreduce` of the list, one in-place XLA custom call in the compiled step (the
same on every rank) in which each gradient is its own collective, a large one reduced alone in
XLA's buffer and small ones fused by the core, and a float Average's division fused by XLA into
the optimizer's update (docs/jax.md#inside-jaxjit). A grouped allreduce would pack every gradient
into one fusion buffer and unpack the results: two copies of the model's gradients per step. At one
rank the program holds no call at all.
"""

from __future__ import annotations

from typing import Any

from ..engine.protocol import ReduceOp
from ..jax import allreduce as _allreduce
from ..process_sets import ProcessSet


def grouped_allreduce(grads: list[Any], name: str, op: ReduceOp, process_set: ProcessSet,
                      prescale: float = 1.0, postscale: float = 1.0) -> list[Any]:
    """Reduce ``grads`` (jax arrays, concrete or traced), gradient i named ``<name>[i]``; returns
    new arrays in order. Inside jit every gradient is in the one custom call, so they run
    together on every rank, as a group would."""
    return list(_allreduce(list(grads), name=name, op=op, process_set=process_set,
                           prescale_factor=prescale, postscale_factor=postscale))


def densify(grads: list[Any]) -> list[Any]:
    """``grads`` as they are: this backend's gradients are always dense."""
    return list(grads)
