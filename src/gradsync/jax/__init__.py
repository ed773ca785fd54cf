"""The JAX adapter: collectives on jax arrays and pytrees, and data-parallel training with optax.

Importing it imports jax; ``import gradsync`` alone does not (and ``DistributedOptimizer`` imports
optax only when called). Four lines make a single-process JAX + optax script data-parallel::

    import gradsync, gradsync.jax
    gradsync.init()
    tx = gradsync.jax.DistributedOptimizer(optax.sgd(lr * gradsync.size()))
    params = gradsync.jax.broadcast_parameters(params, root_rank=0)

``gradsync.jax.elastic`` keeps pytrees across the elastic driver's restarts (docs/elastic.md).
The collectives work outside ``jax.jit`` and inside it; see docs/jax.md. jax arrays are immutable,
so there are no in-place forms (``allreduce_``): every op returns new arrays. The handles of the
``*_async`` ops are waited on with ``gradsync.synchronize`` and tested with ``gradsync.poll``.
"""

from __future__ import annotations

from . import elastic
from .collectives import (
    JaxHandle,
    allgather,
    allgather_async,
    allreduce,
    allreduce_async,
    alltoall,
    broadcast,
    broadcast_async,
    grouped_allreduce,
    grouped_allreduce_async,
    reducescatter,
)
from .optimizer import DistributedOptimizer, average_metrics, broadcast_parameters

__all__ = [
    "allreduce", "allreduce_async", "grouped_allreduce", "grouped_allreduce_async",
    "broadcast", "broadcast_async", "allgather", "allgather_async", "reducescatter", "alltoall",
    "JaxHandle",
    "DistributedOptimizer", "broadcast_parameters", "average_metrics", "elastic",
]


def __getattr__(name: str):
    if name.endswith("_") and name.rstrip("_") in __all__:
        raise AttributeError(f"gradsync.jax has no {name}: jax arrays are immutable, so there are no "
                             f"in-place ops; use gradsync.jax.{name.rstrip('_')}, which returns new arrays")
    raise AttributeError(f"module 'gradsync.jax' has no attribute {name!r}")
