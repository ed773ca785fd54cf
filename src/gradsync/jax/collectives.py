"""The collectives on jax arrays and pytrees of them, outside ``jax.jit`` and inside it.

Every op takes a pytree (a single ``jax.Array`` is a pytree of one leaf) and returns a pytree of
the same structure holding new jax arrays, each on its input's device. Underneath, each leaf is a
collective of the core (:mod:`gradsync.ops`), negotiated and fused as any other.

* **Outside jit** the leaves go to the core as read-only host views (no copy on the CPU, see
  :mod:`gradsync.jax.array`); the ``*_async`` forms return a :class:`JaxHandle`.
* **Inside jit** (and ``lax.scan``/``cond``/``while_loop``) the blocking forms put one call into
  the program for the whole pytree, the same on every rank. Allreduces on the CPU: an in-place
  XLA custom call (:mod:`gradsync.jax.xla_ffi`) whose handler has the core reduce the leaves in
  XLA's own buffers, no copy in or out. The others: a
  ``jax.experimental.io_callback(..., ordered=True)``, which XLA runs in program order; the host
  function submits the leaves to the core, waits, and hands the results back to XLA (a copy).
  Either way the waiting thread runs the coordinator's cycle itself when it is idle.

**Names.** A leaf of a named op is named ``<name><path>``, its key path in the pytree
(``"grads['w1']"``; a bare array: ``name`` itself; a path that repeats among the leaves, which a
custom pytree node's keys can, gets ``#<leaf index>``). Unnamed ops outside jit are numbered by the
core, in the order this rank issues them. Unnamed ops inside jit are numbered when XLA runs them
(``jit.<kind>.noname.<n>``, a count of its own), so that a jitted step that runs while the Python
thread issues other unnamed ops cannot shift the numbering. A named op inside jit reuses its names
every step, which lets the response cache skip negotiation: name ops that run every step.

This module holds the public ops, their :class:`JaxHandle`, and how a call runs: at once on
concrete arrays, not at all when it is the identity, inside jit through the custom call or the
io_callback. What each kind does with the leaves (how it submits them, its result shape inside
jit, the allreduce's custom call) and the pytree's flattening and names: :mod:`gradsync.jax.kinds`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.experimental import io_callback

from .. import ops
from ..arrays import dtypes
from ..engine.protocol import ReduceOp
from ..handles import Handle
from ..process import runtime
from ..process_sets import ProcessSet, global_process_set
from .array import check_concrete, single_device, to_jax
from .kinds import (
    Allgather,
    Allreduce,
    Broadcast,
    GroupedAllreduce,
    Leaves,
    Reducescatter,
    flatten,
    jit_name,
    leaf_names,
)


@dataclasses.dataclass(frozen=True)
class JaxHandle:
    """The pending result of a ``gradsync.jax`` ``*_async`` collective.

    Wait with :func:`gradsync.synchronize` (or :meth:`wait`), which returns the pytree of new jax
    arrays; test with :func:`gradsync.poll` (or :meth:`done`).
    """

    name: str
    handles: tuple[Handle, ...]  #: the core handle of each leaf, in leaf order
    finish: Callable[[list[np.ndarray]], Any]  #: host results in leaf order -> the result pytree

    def done(self) -> bool:
        """True once every leaf's collective has finished, successfully or not; never blocks."""
        return all(handle.done() for handle in self.handles)

    def wait(self, timeout: float | None = None) -> Any:
        """Block until every leaf's collective finished; return the result pytree.

        Raises:
            TimeoutError: ``timeout`` (seconds, for each leaf in turn) passed first.
            gradsync.CollectiveError, gradsync.ShutdownError, gradsync.RankFailureError: a leaf's
                collective failed (the message names it and the rank).
        """
        return self.finish([handle.wait(timeout) for handle in self.handles])


def _op(op: Any, what: str) -> ReduceOp:
    try:
        return ReduceOp(op)
    except ValueError:
        raise ValueError(f"gradsync: rank {runtime.get().rank}: gradsync.jax.{what}: op={op!r} is not "
                         f"one of {[o.name for o in ReduceOp]}") from None


def _is_traced(leaves: Leaves) -> bool:
    return any(isinstance(leaf, jax.core.Tracer) for leaf in leaves.arrays)


def _start(spec, leaves: Leaves, name: str | None, what: str) -> JaxHandle:
    """Submit every leaf of a concrete pytree; the handle rebuilds the pytree from the results."""
    for array in leaves.arrays:
        check_concrete(array, f"gradsync.jax.{what}")
    where = f"gradsync: rank {runtime.get().rank}: gradsync.jax.{what}"
    # Anything that is not a jax array (numpy, or what the core then refuses) has no device.
    devices = [single_device(a, where) if isinstance(a, jax.Array) else None for a in leaves.arrays]
    handles = spec.submit(leaves.arrays, leaf_names(name, leaves.paths), name)

    def finish(results: list[np.ndarray]) -> Any:
        return leaves.rebuild(to_jax(results, devices))

    return JaxHandle(name or spec.kind, tuple(handles), finish)


def _run(spec, tree: Any, name: str | None) -> Any:
    """The blocking op: at once on concrete arrays, through an ordered io_callback when traced;
    an allreduce that is the identity (one rank, no scale factor) runs nothing (:func:`_identity`)."""
    leaves = flatten(tree)
    if _is_identity(spec, leaves):
        return leaves.rebuild(_identity(spec, leaves))
    if not _is_traced(leaves):
        with ops.blocking(spec.process_set):  # the cycle runs in this thread (caller runs)
            return _start(spec, leaves, name, spec.kind).wait()
    if not leaves.arrays:
        return tree
    return _in_jit(spec, leaves, name)


def _is_identity(spec, leaves: Leaves) -> bool:
    """An allreduce over a set of one rank without scale factors (the core's rule,
    :func:`gradsync.ops.reduction_is_identity`): decided from the set's size and the arguments, the
    same on every rank, and when tracing, so a jitted step holds no call at all then. Traced
    under anything but jit and its control flow (vmap, grad: not a plain jaxpr tracer) it is not:
    the call then refuses the transformation as at any size."""
    if not isinstance(spec, Allreduce) or spec.kind == "reducescatter":
        return False
    if any(isinstance(a, jax.core.Tracer) and type(a).__name__ != "DynamicJaxprTracer"
           for a in leaves.arrays):
        return False
    try:
        names = [dtypes.dtype_name(np.dtype(leaf.dtype)) for leaf in leaves.arrays]
    except (AttributeError, TypeError, ValueError):  # not an array, or a dtype the core refuses
        return False
    return ops.reduction_is_identity(names, spec.op, spec.prescale_factor, spec.postscale_factor,
                                     spec.process_set)


def _identity(spec, leaves: Leaves) -> list[Any]:
    """The leaves as the result of a reduction of one rank. Traced: the leaves themselves (the
    program is unchanged: no custom call, no copy). Concrete: new jax arrays (a copy on the leaf's
    device, so that a result can be donated without deleting its input), as every op returns."""
    if _is_traced(leaves):
        _refuse_named_axes(spec.kind)
        return [jax.numpy.asarray(a) for a in leaves.arrays]
    where = f"gradsync: rank {runtime.get().rank}: gradsync.jax.{spec.kind}"
    out = []
    for array in leaves.arrays:
        if isinstance(array, jax.Array):
            out.append(jax.device_put(array, single_device(array, where), may_alias=False))
        else:  # numpy: copied onto jax's default device, as the core's results would be
            out.append(jax.numpy.array(array, copy=True))
    return out


def _in_jit(spec, leaves: Leaves, name: str | None) -> Any:
    """Allreduces on the CPU: one in-place custom call for the pytree (``spec.in_jit``); other
    collectives (and any on another backend): one ordered io_callback for every leaf."""
    _refuse_named_axes(spec.kind)
    arrays = [jax.numpy.asarray(a) for a in leaves.arrays]  # python scalars inside a traced pytree
    if getattr(spec, "in_jit", None) is not None and jax.default_backend() == "cpu":
        try:
            return leaves.rebuild(spec.in_jit(leaves, arrays, name))
        except (ValueError, NotImplementedError) as exc:  # raised while tracing: vmap, grad
            raise TypeError(_unsupported_transform(spec.kind, str(exc))) from exc
    shapes = [spec.out_shape(tuple(a.shape)) for a in arrays]
    results = [jax.ShapeDtypeStruct(shape, a.dtype) for shape, a in zip(shapes, arrays)]

    def on_host(*values: Any) -> list[np.ndarray]:
        base = jit_name(spec, name)
        with ops.blocking(spec.process_set):  # the cycle runs in this thread (caller runs)
            handles = spec.submit(list(values), leaf_names(base, leaves.paths), base)
            out = [handle.wait() for handle in handles]
        for result, shape, path in zip(out, shapes, leaves.paths):
            if result.shape != shape:  # allgather with dimension 0 differing between ranks
                raise ValueError(f"gradsync: rank {runtime.get().rank}: gradsync.jax.{spec.kind} "
                                 f"{base}{path} inside jax.jit: the result has shape {result.shape}, "
                                 f"not the {shape} that the traced program expects; inside jit every "
                                 "rank must pass the same shapes (call it outside jit otherwise)")
        return out

    try:
        out = io_callback(on_host, results, *arrays, ordered=True)
    except ValueError as exc:  # raised while tracing: vmap and differentiation
        raise TypeError(_unsupported_transform(spec.kind, str(exc))) from exc
    return leaves.rebuild(list(out))


def _unsupported_transform(kind: str, message: str) -> str:
    if "vmap" in message:
        return (f"gradsync.jax.{kind} cannot run under jax.vmap: it is one collective per rank, not "
                "per batch element; call it on the whole batched array outside the vmapped function")
    if "JVP" in message or "transpose" in message or "differentiated" in message:
        return (f"gradsync.jax.{kind} is not differentiable (jax.grad, jvp and vjp cannot pass "
                "through a collective); compute the gradients first, then average them with "
                "gradsync.jax.DistributedOptimizer or gradsync.jax.grouped_allreduce")
    return f"gradsync.jax.{kind} inside a jax transformation: {message}"


def _refuse_named_axes(kind: str) -> None:
    """pmap and shard_map run the traced function once per device, so its collective would run
    several times per rank. They show as named axes in jax's axis environment (no public API)."""
    try:
        from jax._src import core as jax_core

        axes = dict(jax_core.get_axis_env().axis_sizes)
    except (ImportError, AttributeError):  # another jax: nothing to look at
        return
    if axes:
        raise TypeError(f"gradsync.jax.{kind} cannot run inside jax.pmap or shard_map (named axes "
                        f"{axes}): gradsync runs one process per device, each with one copy of the "
                        "program; use jax.jit on each rank's own device instead")


def allreduce_async(tree: Any, name: str | None = None, op: ReduceOp = ReduceOp.Average,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> JaxHandle:
    """Start an allreduce of every leaf of ``tree``; same semantics as MPI_Allreduce, per leaf.

    Each leaf is its own collective (the core still fuses small ones that are ready together);
    for one unit use :func:`grouped_allreduce_async`. Outside jit only: it returns a handle.

    Args:
        tree: a ``jax.Array``, or a pytree of them (numpy arrays allowed), each of a dtype of
            :data:`gradsync.arrays.dtypes.SUPPORTED`, on one device; the same structure, shapes and
            dtypes on every rank.
        name: identifies the collective across ranks; leaves are named ``<name><key path>``.
        op: ``Average`` (default), ``Sum``, ``Min``, ``Max``, ``Product``, with the dtype rules of
            :func:`gradsync.allreduce_async`.
        prescale_factor: multiplies each input before the reduction (floating dtypes only).
        postscale_factor: multiplies each result after it (floating dtypes only).
        process_set: the ranks that take part (default: every rank).

    Returns:
        A :class:`JaxHandle`; :func:`gradsync.synchronize` returns a pytree of the same structure
        of new jax arrays, each on its input's device (numpy leaves: on the CPU).

    Raises:
        TypeError: a traced leaf (inside ``jax.jit``: use :func:`allreduce`); a leaf sharded over
            several devices; the errors of :func:`gradsync.allreduce_async`, naming the leaf.
        ValueError, NotInitializedError, CollectiveError: as :func:`gradsync.allreduce_async`.
    """
    spec = Allreduce(_op(op, "allreduce_async"), prescale_factor, postscale_factor, process_set)
    return _start(spec, flatten(tree), name, "allreduce_async")


def allreduce(tree: Any, name: str | None = None, op: ReduceOp = ReduceOp.Average,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> Any:
    """Blocking :func:`allreduce_async`: returns the pytree of reduced (new) jax arrays.

    Works inside ``jax.jit`` too (one in-place XLA custom call for the whole pytree; see the
    module docstring), but not under ``vmap``, ``pmap``, ``shard_map`` or differentiation (TypeError).
    """
    spec = Allreduce(_op(op, "allreduce"), prescale_factor, postscale_factor, process_set)
    return _run(spec, tree, name)


def grouped_allreduce_async(tree: Any, name: str | None = None, op: ReduceOp = ReduceOp.Average,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> JaxHandle:
    """Start an allreduce of the whole pytree as one unit: same semantics as
    :func:`gradsync.grouped_allreduce_async` on its leaves.

    None of the leaves runs before every rank submitted all of them; then all run fused in one
    buffer whatever the fusion threshold, and a mismatch in any fails them all on every rank. A
    core group holds one dtype, so a pytree of several dtypes makes one group per dtype (in the
    order the dtypes first occur among the leaves), named ``<name>.<dtype>`` (members
    ``<name>.<dtype>.0``, ...). Outside jit only; arguments, result and errors as
    :func:`allreduce_async`.
    """
    spec = GroupedAllreduce(_op(op, "grouped_allreduce_async"), prescale_factor, postscale_factor,
                             process_set)
    return _start(spec, flatten(tree), name, "grouped_allreduce_async")


def grouped_allreduce(tree: Any, name: str | None = None, op: ReduceOp = ReduceOp.Average,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> Any:
    """Blocking :func:`grouped_allreduce_async`; works inside ``jax.jit`` as :func:`allreduce` does.

    This is what :func:`gradsync.jax.DistributedOptimizer` calls on the gradient pytree.
    """
    spec = GroupedAllreduce(_op(op, "grouped_allreduce"), prescale_factor, postscale_factor,
                             process_set)
    return _run(spec, tree, name)


def broadcast_async(tree: Any, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> JaxHandle:
    """Start a broadcast of ``root_rank``'s ``tree`` to every rank; same semantics as MPI_Bcast,
    per leaf.

    Every rank passes a pytree of the same structure, shapes and dtypes (its values matter on the
    root only). Outside jit only; :func:`gradsync.synchronize` returns the root's values as new
    jax arrays, each on this rank's input's device.

    Raises:
        ValueError: ``root_rank`` not a rank (of ``process_set``). Others as :func:`allreduce_async`.
    """
    return _start(Broadcast(root_rank, process_set), flatten(tree), name, "broadcast_async")


def broadcast(tree: Any, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> Any:
    """Blocking :func:`broadcast_async`; works inside ``jax.jit`` as :func:`allreduce` does."""
    return _run(Broadcast(root_rank, process_set), tree, name)


def allgather_async(tree: Any, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> JaxHandle:
    """Start an allgather of every leaf: the ranks' arrays concatenated along dimension 0, in rank
    order; same semantics as MPI_Allgatherv, per leaf.

    Each leaf needs at least one dimension; dimension 0 may differ between ranks (outside jit),
    the others and the dtype must match. Outside jit only.

    Raises:
        ValueError: a 0-d leaf. Others as :func:`allreduce_async`.
    """
    return _start(Allgather(process_set), flatten(tree), name, "allgather_async")


def allgather(tree: Any, name: str | None = None, process_set: ProcessSet = global_process_set) -> Any:
    """Blocking :func:`allgather_async`; works inside ``jax.jit`` as :func:`allreduce` does, where
    the output shape must be known when tracing: every rank must pass the same dimension 0 there
    (else the callback fails with a ValueError naming both shapes)."""
    return _run(Allgather(process_set), tree, name)


def reducescatter(tree: Any, name: str | None = None, op: ReduceOp = ReduceOp.Average,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                  process_set: ProcessSet = global_process_set) -> Any:
    """Reduce every leaf across ranks and return this rank's block of rows of each; same semantics
    as :func:`gradsync.reducescatter` (rank r gets ``N // size`` rows, plus one if
    ``r < N % size``). Blocking; works inside ``jax.jit`` as :func:`allreduce` does.

    Raises:
        ValueError: a 0-d leaf. Others as :func:`allreduce_async`.
    """
    spec = Reducescatter(_op(op, "reducescatter"), prescale_factor, postscale_factor, process_set)
    return _run(spec, tree, name)


def alltoall(array: Any, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> tuple[jax.Array, jax.Array]:
    """Send ``splits[r]`` rows of ``array`` to each rank r and receive every rank's rows for this
    one; same semantics as :func:`gradsync.alltoall` (MPI_Alltoallv along dimension 0).

    One array, not a pytree, and outside jit only: the output's shape depends on the other ranks'
    splits, which a traced program cannot know.

    Returns:
        ``(output, received_splits)``: new jax arrays, the output on the input's device.

    Raises:
        TypeError: a traced array (inside ``jax.jit``). Others as :func:`gradsync.alltoall`.
    """
    check_concrete(array, "gradsync.jax.alltoall")
    where = f"gradsync: rank {runtime.get().rank}: gradsync.jax.alltoall"
    device = single_device(array, where) if isinstance(array, jax.Array) else None
    output, received = ops.alltoall(array, splits, name, process_set)
    output, received = to_jax([output, received], [device, device])
    return output, received
