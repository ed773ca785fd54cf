"""Data-parallel training with optax: the gradient-averaging optimizer, parameter broadcast, metrics."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

from .. import metrics
from ..engine.protocol import ReduceOp
from ..process_sets import ProcessSet, global_process_set
from .collectives import allreduce, broadcast


def DistributedOptimizer(tx: Any, op: ReduceOp = ReduceOp.Average, name: str = "gradients",  # noqa: N802
                         process_set: ProcessSet = global_process_set) -> Any:
    """Wrap an optax ``GradientTransformation`` so that its ``update`` averages the gradients across
    ranks first: N ranks then take the same steps as one process on their concatenated batches.

    ``update(grads, state, params=None, **extra_args)`` averages the gradient pytree
    (:func:`gradsync.jax.allreduce`: each leaf a collective named ``<name><key path>``; the core
    reduces a leaf above the fusion threshold alone in its own memory, which inside jit is XLA's
    buffer, and fuses the small ones; docs/performance-notes.md, fact 4) and passes the result to
    ``tx.update``, compiled (``jax.jit(tx.update)``, so a call outside jit does not run the
    wrapped update op by op; extra args must then be arrays or pytrees of them). It works outside
    ``jax.jit`` and inside it (an in-place XLA custom call, the same on every rank), inside
    ``lax.cond``/``scan`` and under
    ``optax.MultiSteps`` (gradient accumulation: only the k-th micro-step communicates). Every
    rank must call it the same number of times. ``init`` is ``tx.init``: give every rank the same
    parameters first (:func:`broadcast_parameters`), and scale the learning rate with the number
    of ranks if the per-rank batch stays the same. Same role as ``horovod.torch.DistributedOptimizer``.

    Args:
        tx: an optax ``GradientTransformation`` (with or without extra args).
        op: ``Average`` (default) or ``Sum`` of the gradients.
        name: the collective's name, the same every step so that the response cache skips
            negotiation; give each optimizer of a program a name of its own.
        process_set: the ranks that average their gradients (default: every rank).

    Returns:
        An ``optax.GradientTransformationExtraArgs``: use it wherever optax expects a
        transformation (``optax.chain``, ``optax.MultiSteps``, ...).

    Raises:
        ImportError: optax is not installed (``pip install gradsync[jax]``).
        TypeError (from ``update``): a gradient leaf of an unsupported dtype, sharded over several
            devices, or ``update`` under ``vmap``/``pmap``/``shard_map``/differentiation.
        gradsync.CollectiveError (from ``update``): the ranks' gradient pytrees differ in shape
            or dtype; the message names the leaf and each rank's value.
    """
    import optax

    inner = optax.with_extra_args_support(tx)
    # Called outside jit, the wrapped update would otherwise run op by op (~10 us per jax op here);
    # inside a traced function a jitted function is simply inlined.
    compiled = jax.jit(inner.update)

    def update(grads: Any, state: Any, params: Any = None, **extra_args: Any) -> tuple[Any, Any]:
        averaged = allreduce(grads, name=name, op=op, process_set=process_set)
        return compiled(averaged, state, params, **extra_args)

    return optax.GradientTransformationExtraArgs(inner.init, update)


def broadcast_parameters(params: Any, root_rank: int = 0, name: str = "broadcast_parameters",
                         process_set: ProcessSet = global_process_set) -> Any:
    """Return ``root_rank``'s ``params`` on every rank: a new pytree of the same structure.

    Call it once after initialising the model (and after loading a checkpoint on the root) so that
    every rank starts from the same weights; it works for an optimizer state too (pass another
    ``name``). Same semantics as :func:`gradsync.jax.broadcast` (MPI_Bcast per leaf), which also
    works inside ``jax.jit``.

    Args:
        params: a pytree of jax (or numpy) arrays, the same structure, shapes and dtypes on every
            rank (only the root's values matter).
        root_rank: the (world) rank whose values every rank gets.
        name: the collective's name; leaves are ``<name><key path>``.
        process_set: the ranks that take part (default: every rank); ``root_rank`` must be one.

    Returns:
        The root's values, as new jax arrays on each rank's own devices.

    Raises:
        ValueError: ``root_rank`` is not a rank (of ``process_set``).
        TypeError, gradsync.CollectiveError: as :func:`gradsync.jax.broadcast`.
    """
    return broadcast(params, root_rank, name=name, process_set=process_set)


def average_metrics(values: Mapping[str, Any], name: str | None = None) -> dict[str, float]:
    """Average named scalars (jax arrays, numpy or python numbers) across ranks, for logging.

    One device-to-host transfer for all of them (``jax.device_get``), then
    :func:`gradsync.metrics.average_scalars`: one collective, float64, the same python floats on
    every rank, keys sorted. For weighted means over many steps use
    :class:`gradsync.metrics.Metric`, which takes jax scalars as they are. Outside jit only.

    Args:
        values: key -> a 0-d value, e.g. ``{"loss": loss, "accuracy": accuracy}``; the same keys
            on every rank.
        name: identifies the collective across ranks, as for :func:`gradsync.allgather`.

    Returns:
        key -> the mean of its value over every rank.

    Raises:
        TypeError: a value that is not a real scalar, or a traced one (inside ``jax.jit``).
        ValueError: the ranks passed different keys (every rank raises; the message lists them).
    """
    if not isinstance(values, Mapping):
        return metrics.average_scalars(values, name=name)  # its TypeError names what it got
    if any(isinstance(v, jax.core.Tracer) for v in values.values()):
        raise TypeError("gradsync.jax.average_metrics is for logging outside jax.jit; return the "
                        "metrics from the jitted step, or use gradsync.jax.allreduce inside it")
    return metrics.average_scalars(jax.device_get(dict(values)), name=name)
