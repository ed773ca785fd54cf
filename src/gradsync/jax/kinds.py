"""Each collective kind of :mod:`gradsync.jax.collectives` on a pytree's leaves, and the pytree itself.

:func:`flatten` turns a pytree into its :class:`Leaves` (the arrays, their key paths, how to
rebuild it); :func:`leaf_names` and :func:`jit_name` name them (the rules: the "Names" paragraph
of :mod:`gradsync.jax.collectives`). One frozen spec per kind holds the op's arguments and says
how it submits the leaves to the core (``submit``) and, inside ``jax.jit``, the shape of each
result (``out_shape``). :class:`Allreduce` (and :class:`GroupedAllreduce`) also run inside jit
as one in-place XLA custom call (``in_jit``, through :mod:`gradsync.jax.xla_ffi`); the other
kinds go through the ordered ``io_callback`` of :mod:`gradsync.jax.collectives`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from .. import naming, ops
from ..arrays import dtypes
from ..engine.protocol import ReduceOp, split_rows
from ..handles import Handle
from ..process import runtime
from ..process_sets import ProcessSet
from . import xla_ffi


@dataclasses.dataclass(frozen=True)
class Leaves:
    """A flattened pytree: its leaves, their key paths as strings, and how to rebuild it."""

    arrays: list[Any]
    paths: list[str]
    treedef: Any

    def rebuild(self, leaves: list[Any]) -> Any:
        return jax.tree_util.tree_unflatten(self.treedef, leaves)


def flatten(tree: Any) -> Leaves:
    """``tree``'s leaves and their key paths, a path that repeats (a custom node's keys, dict keys
    of the same repr) made unique by the leaf's position (:func:`gradsync.naming.deduplicated`)."""
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return Leaves([leaf for _, leaf in with_paths],
                   naming.deduplicated([jax.tree_util.keystr(path) for path, _ in with_paths]), treedef)


def leaf_names(name: str | None, paths: list[str]) -> list[str | None]:
    return [None if name is None else f"{name}{path}" for path in paths]


def by_dtype(arrays: list[Any]) -> dict[str, list[int]]:
    """dtype name -> the indices of the arrays of that dtype, dtypes in order of first occurrence."""
    groups: dict[str, list[int]] = {}
    for i, array in enumerate(arrays):
        groups.setdefault(dtypes.dtype_name(np.dtype(array.dtype)), []).append(i)
    return groups


def jit_name(spec, name: str | None) -> str:
    """The op's name inside jit: its own, or numbered as XLA runs it (the "Names" paragraph of
    :mod:`gradsync.jax.collectives`)."""
    if name is not None:
        return name
    return runtime.get().auto_name(f"jit.{spec.kind}", spec.process_set.process_set_id)


@dataclasses.dataclass(frozen=True)
class Allreduce:
    op: ReduceOp
    prescale_factor: float
    postscale_factor: float
    process_set: ProcessSet
    kind = "allreduce"

    def submit(self, arrays: list[Any], names: list[str | None], name: str | None,
               in_place: bool = False) -> list[Handle]:
        start = ops.allreduce_async_ if in_place else ops.allreduce_async
        return [start(a, n, self.op, self.prescale_factor, self.postscale_factor, self.process_set)
                for a, n in zip(arrays, names)]

    def in_jit(self, leaves: Leaves, arrays: list[Any], name: str | None) -> list[Any]:
        """The leaves, as they lie in XLA's buffers, reduced in place by one custom call
        (:mod:`.xla_ffi`): no copy on the host but the core's fusion (a grouped allreduce packs
        each dtype's leaves into its fusion buffer and unpacks the results into XLA's buffers).
        Packing the leaves inside the program instead (``jnp.concatenate``, then slices) cost
        XLA 4-5 ms more per step on a 7.4 MB pytree than the core's two copies.

        The Average divisor of the leaves of :meth:`_divides_in_xla` is applied by the program:
        the core sums them, the call also returns ``1 / divisor`` of each (the divisor the core
        decided, :attr:`gradsync.Handle.divisor`), and the multiply fuses into whatever reads the
        result (the optimizer's update) instead of being a pass of its own over the memory. It is
        the core's own rounding (a float32 result times the float32 nearest ``1 / divisor``)."""
        folded = [i for i, a in enumerate(arrays) if self._divides_in_xla(a)]

        def body(outputs: list[np.ndarray]) -> None:
            base = jit_name(self, name)
            with ops.blocking(self.process_set):  # the cycle runs in this thread (caller runs)
                handles = self._submit_in_place(outputs[:len(arrays)],
                                                leaf_names(base, leaves.paths), base, folded)
                for handle in handles:
                    handle.wait()
            for scale, i in zip(outputs[len(arrays):], folded):
                scale[...] = 1.0 / handles[i].divisor

        scales = [jax.ShapeDtypeStruct((), arrays[i].dtype) for i in folded]
        out = xla_ffi.call(body, arrays, scales)
        results = out[:len(arrays)]
        for scale, i in zip(out[len(arrays):], folded):
            results[i] = results[i] * scale
        return results

    def _divides_in_xla(self, array: Any) -> bool:
        """Whether the program, not the core, divides this leaf's Average: a float32 or float64
        leaf (rounded once either way; 16-bit ones are averaged in float32 by the core) with no
        postscale, over more than one rank. The same on every rank (op, dtype and set are)."""
        return (self.op == ReduceOp.Average and self.postscale_factor == 1.0
                and np.dtype(array.dtype).name in ("float32", "float64")
                and self.process_set.size() > 1)

    def _submit_in_place(self, outputs: list[np.ndarray], names: list[str | None], name: str,
                         folded: list[int]) -> list[Handle]:
        """Submit every leaf in place, those in ``folded`` as a Sum; the handles in leaf order."""
        handles: list[Any] = [None] * len(outputs)
        kept = [i for i in range(len(outputs)) if i not in folded]
        for spec, members in ((dataclasses.replace(self, op=ReduceOp.Sum), folded), (self, kept)):
            if members:
                started = spec.submit([outputs[i] for i in members], [names[i] for i in members],
                                      name, True)
                for i, handle in zip(members, started):
                    handles[i] = handle
        return handles

    def out_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return shape


@dataclasses.dataclass(frozen=True)
class GroupedAllreduce(Allreduce):
    kind = "grouped_allreduce"

    def submit(self, arrays: list[Any], names: list[str | None], name: str | None,
               in_place: bool = False) -> list[Handle]:
        """One core group per dtype, in the order the dtypes first occur (a group is one dtype,
        fused into one buffer); each named ``<name>.<dtype>``."""
        start = ops.grouped_allreduce_async_ if in_place else ops.grouped_allreduce_async
        handles: list[Handle | None] = [None] * len(arrays)
        for dtype, members in by_dtype(arrays).items():
            group = start([arrays[i] for i in members], None if name is None else f"{name}.{dtype}",
                          self.op, self.prescale_factor, self.postscale_factor, self.process_set)
            for i, handle in zip(members, group.handles):
                handles[i] = handle
        return handles


@dataclasses.dataclass(frozen=True)
class Broadcast:
    root_rank: int
    process_set: ProcessSet
    kind = "broadcast"

    def submit(self, arrays: list[Any], names: list[str | None], name: str | None) -> list[Handle]:
        return [ops.broadcast_async(a, self.root_rank, n, self.process_set)
                for a, n in zip(arrays, names)]

    def out_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return shape


@dataclasses.dataclass(frozen=True)
class Allgather:
    process_set: ProcessSet
    kind = "allgather"

    def submit(self, arrays: list[Any], names: list[str | None], name: str | None) -> list[Handle]:
        return [ops.allgather_async(a, n, self.process_set) for a, n in zip(arrays, names)]

    def out_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Inside jit the output shape is static: every rank must have the same dimension 0."""
        if not shape:
            raise ValueError("gradsync.jax.allgather needs at least one dimension, got a 0-d array "
                             "(reshape it to (1,))")
        return (shape[0] * self.process_set.size(),) + tuple(shape[1:])


@dataclasses.dataclass(frozen=True)
class Reducescatter(Allreduce):
    kind = "reducescatter"
    in_jit = None  # its output is not its input's shape: an io_callback (collectives._in_jit)

    def submit(self, arrays: list[Any], names: list[str | None], name: str | None) -> list[Handle]:
        return [ops.reducescatter_async(a, n, self.op, self.prescale_factor, self.postscale_factor,
                                        self.process_set) for a, n in zip(arrays, names)]

    def out_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        if not shape:
            raise ValueError("gradsync.jax.reducescatter needs at least one dimension to scatter, got "
                             "a 0-d array (reshape it to (1,))")
        rows = split_rows(shape[0], self.process_set.size())[self.process_set.rank()]
        return (rows,) + tuple(shape[1:])

