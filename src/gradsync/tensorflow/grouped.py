"""Horovod's grouped allgather and reducescatter and its variable broadcasts
(``horovod.tensorflow.grouped_allgather``, ``grouped_reducescatter``, ``broadcast_``,
``broadcast_variables``, ``broadcast_global_variables``) on gradsync's core groups.

Each is one op (:func:`~gradsync.tensorflow.host_op.call_on_host`), eagerly, in a tf.function and
in a TF1 graph: the members are submitted to the core together (one core group per dtype for the
grouped ops, named ``<name>.<dtype>``) and waited on together.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from .. import naming, ops
from ..process_sets import ProcessSet, global_process_set
from .compression import Compression
from .host_op import call_on_host
from .mpi_ops import _normalize_name as _normalize
from .mpi_ops import (
    allgather_grad,
    collective_name,
    grouped_reduce,
    groups_by_dtype,
    needs_rows,
    reduce_op,
    reducescatter_grad,
)


def _member(name: str | None, i: int) -> str | None:
    return None if name is None else f"{name}.{i}"


def _gathered(tensors: list[tf.Tensor], name: str | None, process_set: ProcessSet) -> list[tf.Tensor]:
    """The grouped allgather op of ``tensors``; not differentiable."""
    groups = groups_by_dtype(tensors)

    def on_host(*arrays: np.ndarray) -> list[np.ndarray]:
        started = [(members, ops.grouped_allgather_async([arrays[i] for i in members],
                                                         None if name is None else f"{name}.{dtype}",
                                                         process_set))
                   for dtype, members in groups.items()]
        results = {}
        for members, handle in started:  # every group submitted before any is waited on
            results.update(zip(members, handle.wait()))
        return [results[i] for i in range(len(arrays))]

    return call_on_host("grouped_allgather", on_host, tensors, [t.dtype for t in tensors],
                        [[None] + t.shape[1:] for t in tensors], name)


def grouped_allgather(tensors: Sequence[Any], name: str | None = None, ignore_name_scope: bool = False,
                      process_set: ProcessSet = global_process_set) -> list[tf.Tensor]:
    """Allgather every tensor of ``tensors`` as one unit (``horovod.tensorflow.grouped_allgather``):
    member i is :func:`~gradsync.tensorflow.allgather` of ``tensors[i]`` (every rank's rows
    concatenated along dimension 0 in rank order; dimension 0 may differ between ranks), all
    negotiated together and moved together (:func:`gradsync.grouped_allgather`, one core group per
    dtype).

    Every rank passes the same number of tensors, in the same order, with the same dtypes and
    trailing shapes. Returns a list of new tensors; differentiable (member i's gradient is
    :func:`~gradsync.tensorflow.allgather`'s: this rank's rows of the averaged output gradient).

    Raises:
        ValueError: a 0-d member.
        tf.errors.FailedPreconditionError: the ranks disagree on a member, when the op runs (as
            :func:`~gradsync.tensorflow.allreduce`).
    """
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    for tensor in tensors:
        needs_rows(tensor, "grouped_allgather")
    name = collective_name(name, "grouped_allgather", tensors[0], ignore_name_scope)

    @tf.custom_gradient
    def gather(*xs):
        def grad(*dys):
            return [allgather_grad(x, dy, _member(name, i), process_set)
                    for i, (x, dy) in enumerate(zip(xs, dys))]
        return _gathered(list(xs), name, process_set), grad

    return list(gather(*tensors))


def grouped_reducescatter(tensors: Sequence[Any], device_dense: str = "",
                          compression: Any = Compression.none, op: Any = None,
                          process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0, name: str | None = None) -> list[tf.Tensor]:
    """Reducescatter every tensor of ``tensors`` as one unit
    (``horovod.tensorflow.grouped_reducescatter``): member i is
    :func:`~gradsync.tensorflow.reducescatter` of ``tensors[i]`` (rank r gets ``N // size`` rows of
    the reduction, plus one if ``r < N % size``), negotiated and reduced together
    (:func:`gradsync.grouped_reducescatter`, one core group per dtype).

    ``op`` is ``Average`` (default, also for None) or ``Sum`` (and Min, Max, Product); integer
    tensors are scaled in float64 and truncated, as Horovod does. ``device_dense`` is accepted for
    Horovod's signature; ``name`` (gradsync's addition) names the group. Differentiable: member
    i's gradient is :func:`~gradsync.tensorflow.reducescatter`'s.

    Raises:
        ValueError: a 0-d member, an unknown ``op``.
        tf.errors.FailedPreconditionError: as :func:`~gradsync.tensorflow.allreduce`.
    """
    op = reduce_op(op, None, "grouped_reducescatter")
    compressed = [compression.compress(tf.convert_to_tensor(t)) for t in tensors]
    inputs = [c for c, _ in compressed]
    if not inputs:
        return []
    for tensor in inputs:
        needs_rows(tensor, "grouped_reducescatter")
    name = collective_name(name, "grouped_reducescatter", inputs[0])

    @tf.custom_gradient
    def scatter(*xs):
        def grad(*dys):
            return [reducescatter_grad(dy, _member(name, i), op, prescale_factor, postscale_factor,
                                       process_set) for i, dy in enumerate(dys)]
        return grouped_reduce(xs, name, op, prescale_factor, postscale_factor, process_set,
                              scatter=True), grad

    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(scatter(*inputs), compressed)]


def _assign_broadcast(variables: list[Any], root_rank: int, prefix: str,
                      process_set: ProcessSet) -> list[Any]:
    """Broadcast ``root_rank``'s values of ``variables`` in one op (variable i named
    ``<prefix>.<i>`` eagerly, ``<prefix>.<i>.<its name>`` in a graph; all submitted before any is
    waited on) and assign them: the assign ops (eagerly, already done)."""
    values = [tf.convert_to_tensor(v) for v in variables]
    if not values:
        return []

    # Eagerly the op is done before the call returns, so the position alone is unique, and it
    # stays the same on every rank even where a rank built other models first (Keras numbers
    # layers per process, and optimizer variables carry those numbers). In a graph two broadcast
    # ops may run at once (Horovod's TF2 loop broadcasts the model's and the optimizer's
    # variables in one step): the variable's name tells them apart, the position tells repeated
    # names apart (Keras 3 names every Dense layer's weight "kernel"; gradsync.naming).
    labels = [None if tf.executing_eagerly() else _normalize(getattr(v, "name", None) or "")
              for v in variables]
    names = naming.indexed(prefix, labels)

    def on_host(*arrays: np.ndarray) -> list[np.ndarray]:
        handles = [ops.broadcast_async(a, root_rank, name, process_set)
                   for name, a in zip(names, arrays)]
        return [handle.wait() for handle in handles]

    results = call_on_host("broadcast", on_host, values, [v.dtype for v in values],
                           [v.shape for v in values], prefix)
    return [variable.assign(value) for variable, value in zip(variables, results)]


def broadcast_variables(variables: Iterable[Any], root_rank: int,
                        process_set: ProcessSet = global_process_set, inplace: bool = False) -> Any:
    """Assign ``root_rank``'s values to ``variables`` on every rank
    (``horovod.tensorflow.broadcast_variables``), eagerly, in a tf.function or in a TF1 graph.

    Every rank passes the same variables (same order, shapes, dtypes); they are broadcast in one
    op, variable i under the name ``broadcast_variables.<i>`` eagerly and
    ``broadcast_variables.<i>.<v.name>`` in a graph (variable names may
    repeat, as Keras 3's ``kernel`` and ``bias`` do: the position tells them apart), submitted
    together, then assigned.
    ``inplace`` is accepted for Horovod's signature.

    Returns:
        Eagerly None (the variables are assigned); in a graph the op that assigns them
        (``tf.group``), as Horovod's.

    Raises:
        tf.errors.InvalidArgumentError: ``root_rank`` not a rank of the set.
        tf.errors.FailedPreconditionError: the ranks disagree on a shape (as
            :func:`gradsync.tensorflow.allreduce`).
    """
    assigned = _assign_broadcast(list(variables), root_rank, "broadcast_variables", process_set)
    return None if tf.executing_eagerly() else tf.group(*assigned)


def broadcast_(variables: Sequence[Any], root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> list[tf.Tensor]:
    """Broadcast ``root_rank``'s values into ``variables`` in place (``horovod.tensorflow.broadcast_``):
    every rank's variables are assigned the root's values (resource or TF1 reference variables).

    Every rank passes the same variables (same order, shapes, dtypes); variable i is broadcast
    under the name ``<name>.<i>`` eagerly, ``<name>.<i>.<v.name>`` in a graph (default name
    ``broadcast_``), all in one op.

    Returns:
        The variables' values after the broadcast (in a graph: read after the assignments).

    Raises:
        tf.errors.InvalidArgumentError, tf.errors.FailedPreconditionError: as
            :func:`broadcast_variables`.
    """
    variables = list(variables)
    assigned = _assign_broadcast(variables, root_rank, name or "broadcast_", process_set)
    if tf.executing_eagerly():
        return [v.read_value() for v in variables]
    with tf.control_dependencies(assigned):
        return [tf.identity(v) for v in variables]


def broadcast_global_variables(root_rank: int) -> Any:
    """The op that assigns ``root_rank``'s values to every TF1 global variable
    (``tf.compat.v1.global_variables()``) on every rank
    (``horovod.tensorflow.broadcast_global_variables``; TF1 graphs only, as Horovod's).

    Raises:
        RuntimeError: called eagerly (there are no global variables; use
            :func:`broadcast_variables` with the model's and optimizer's variables).
    """
    if tf.executing_eagerly():
        raise RuntimeError("gradsync.tensorflow.broadcast_global_variables() needs a TF1 graph (it "
                           "broadcasts tf.compat.v1.global_variables()); eagerly, call "
                           "broadcast_variables(<model and optimizer variables>, root_rank) instead")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)
