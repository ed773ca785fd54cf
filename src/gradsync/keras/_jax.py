"""The JAX backend of gradsync.keras: gradients are jax arrays, traced inside the jitted train step.

:func:`gradsync.jax.grouped_allreduce` puts one ordered ``io_callback`` into the compiled step (the
same on every rank), so the averaging runs inside ``model.fit``'s ``jax.jit`` as for optax.
"""

from __future__ import annotations

from typing import Any

from ..engine.protocol import ReduceOp
from ..jax import grouped_allreduce as _grouped_allreduce
from ..process_sets import ProcessSet


def grouped_allreduce(grads: list[Any], name: str, op: ReduceOp, process_set: ProcessSet,
                      prescale: float = 1.0, postscale: float = 1.0) -> list[Any]:
    """Reduce ``grads`` (jax arrays, concrete or traced) as one unit; returns new arrays in order."""
    return list(_grouped_allreduce(list(grads), name=name, op=op, process_set=process_set,
                                   prescale_factor=prescale, postscale_factor=postscale))


def densify(grads: list[Any]) -> list[Any]:
    """``grads`` as they are: this backend's gradients are always dense."""
    return list(grads)
