"""Horovod's TensorFlow collectives (``horovod.tensorflow`` 0.28.1) on ``tf.Tensor``, eagerly and
inside ``tf.function``.

The signatures, argument order and defaults are Horovod's; the work is done by :mod:`gradsync.ops`
on the tensors' host (numpy) values, so every op is negotiated by the coordinator like gradsync's
own. Each call is one TensorFlow op, ``tf.numpy_function(..., stateful=True)``, that submits the
collective to the core, waits for it and hands the result back to TensorFlow: no compiled custom
op, so installing gradsync needs no compiler. Eagerly it runs at once; in a ``tf.function`` it is a
node of the graph that runs when the graph reaches it.

**Ordering in a tf.function.** TensorFlow may run graph ops without data dependencies in any
order. A stateful op without resource inputs is chained after the previous one by TensorFlow's
automatic control dependencies (program order), so gradsync's ops run in the order the Python code
created them, on every rank alike. Collectives are also *named*: an op without ``name=`` in a
``tf.function`` is named after its input tensor (``allreduce.<tensor name>``, as Horovod names it
after the op), the same on every rank since every rank traces the same program, and the same at
every step (the response cache then skips negotiation). Eagerly, unnamed ops are numbered by the
core in the order this rank issues them. Gradients go through one grouped op per dtype
(:class:`gradsync.tensorflow.DistributedGradientTape`), so their order does not matter.

**Gradients** (``tf.custom_gradient``), Horovod's: allreduce's is the allreduce (same op and
factors) of the output's gradient; allgather's this rank's rows of the *averaged* gradient;
broadcast's the averaged gradient on the root and zeros elsewhere; alltoall's the alltoall back
along the received splits; reducescatter's the allgather of the gradient, times the set's size for
``Sum`` and times the scale factors.

Differences from Horovod: integer ``Average`` without scale factors is the floor of the mean
(Horovod truncates toward zero; with factors both scale in float64 and truncate); ranks that
disagree (on a shape, a dtype) raise Horovod's ``tf.errors.FailedPreconditionError`` and bad
arguments found while the op runs ``tf.errors.InvalidArgumentError``, eagerly, in a tf.function
and in a TF1 graph (:func:`~gradsync.tensorflow.host_op.call_on_host`); stalls and rank failures
are gradsync's own errors eagerly (``tf.errors.UnknownError`` in a graph);
``device_dense``/``device_sparse`` are accepted and ignored (gradsync moves host memory; a GPU
tensor is copied through the host).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from .. import ops
from ..engine.protocol import ReduceOp
from ..process import runtime
from ..process_sets import ProcessSet, global_process_set
from .compression import Compression
from .host_op import call_on_host, start_reduction, tf1_graph_number

Average, Sum = ReduceOp.Average, ReduceOp.Sum


def reduce_op(op: Any, average: bool | None, what: str) -> ReduceOp:
    """Horovod's ``average=``/``op=`` pair as one :class:`~gradsync.ReduceOp`: ``op=None`` with
    ``average`` None or True is ``Average``, with False ``Sum``.

    Raises:
        ValueError: both given, or ``op`` not a ReduceOp (the message names the rank and value).
    """
    where = f"gradsync: rank {runtime.get().rank}: gradsync.tensorflow.{what}"
    if op is not None and average is not None:
        raise ValueError(f"{where}: average={average!r} and op={op!r} both given; pass op= only "
                         "(average= is Horovod's deprecated form)")
    if op is None:
        return Sum if average is False else Average
    try:
        return ReduceOp(op)
    except ValueError:
        raise ValueError(f"{where}: op={op!r} is not one of {[o.name for o in ReduceOp]}") from None


def _normalize_name(name: str) -> str:
    """A TensorFlow tensor or scope name as a collective name (Horovod's ``_normalize_name``)."""
    return re.sub(r"[^a-zA-Z0-9_./]", "_", name)


def collective_name(name: str | None, kind: str, tensor: tf.Tensor,
                    ignore_name_scope: bool = False) -> str | None:
    """The collective's name: ``name`` (inside the current name scope in a tf.function, unless
    ``ignore_name_scope``); unnamed in a tf.function, ``<kind>.<input tensor name>``, in a TF1
    graph that plus ``.<number of the collective in the graph>``; unnamed eagerly, None (the core
    numbers it)."""
    if tf.executing_eagerly():
        return name
    if name is None:
        number = tf1_graph_number()
        return f"{kind}.{_normalize_name(tensor.name)}" + ("" if number is None else f".{number}")
    scope = tf.get_current_name_scope()
    return f"{_normalize_name(scope)}/{name}" if scope and not ignore_name_scope else name


def _grad_name(name: str | None) -> str | None:
    return None if name is None else f"{name}.grad"


def groups_by_dtype(tensors: Sequence[tf.Tensor]) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for i, tensor in enumerate(tensors):
        groups.setdefault(tensor.dtype.name, []).append(i)
    return groups


def grouped_reduce(tensors: Sequence[tf.Tensor], name: str | None, op: ReduceOp, prescale: float,
                   postscale: float, process_set: ProcessSet,
                   scatter: bool = False) -> list[tf.Tensor]:
    """Allreduce (``scatter``: reducescatter) ``tensors`` in one op: one core group per dtype
    (named ``<name>.<dtype>``), submitted together and waited on together, integers scaled as
    :func:`~gradsync.tensorflow.host_op.start_reduction` says. Not differentiable."""
    if not tensors:
        return []
    if not scatter and _is_identity(tensors, op, prescale, postscale, process_set):
        return [tf.identity(t) for t in tensors]
    groups = groups_by_dtype(tensors)
    start_group = ops.grouped_reducescatter_async if scatter else ops.grouped_allreduce_async

    def on_host(*arrays: np.ndarray) -> list[np.ndarray]:
        started = [(members, start_reduction(
            lambda xs, o, pre, post, group=None if name is None else f"{name}.{dtype}":
                start_group(xs, group, o, pre, post, process_set),
            [arrays[i] for i in members], op, prescale, postscale)) for dtype, members in groups.items()]
        results = {}
        for members, finish in started:  # every group submitted before any is waited on
            results.update(zip(members, finish()))
        return [results[i] for i in range(len(arrays))]

    shapes = [[None] + t.shape[1:] if scatter else t.shape for t in tensors]
    return call_on_host("grouped_reducescatter" if scatter else "grouped_allreduce", on_host, tensors,
                        [t.dtype for t in tensors], shapes, name)


def _is_identity(tensors: Sequence[tf.Tensor], op: ReduceOp, prescale: float, postscale: float,
                 process_set: ProcessSet) -> bool:
    """An allreduce of one rank without scale factors (:func:`gradsync.ops.reduction_is_identity`,
    the same on every rank): no op, no host round trip, the tensors as they are."""
    return ops.reduction_is_identity([t.dtype.name for t in tensors], op, prescale, postscale,
                                     process_set)


def _allreduce(tensor: tf.Tensor, name: str | None, op: ReduceOp, prescale: float, postscale: float,
               process_set: ProcessSet) -> tf.Tensor:
    """One allreduce op (none for one rank: :func:`_is_identity`); not differentiable, no
    compression."""
    if _is_identity([tensor], op, prescale, postscale, process_set):
        return tf.identity(tensor)
    def on_host(array: np.ndarray) -> list[np.ndarray]:
        return start_reduction(lambda xs, o, pre, post: ops.allreduce_async(xs[0], name, o, pre, post,
                                                                        process_set),
                               [array], op, prescale, postscale)()

    return call_on_host("allreduce", on_host, [tensor], [tensor.dtype], [tensor.shape], name)[0]


def needs_rows(tensor: tf.Tensor, kind: str) -> None:
    if tensor.shape.rank == 0:
        raise ValueError(f"gradsync: rank {runtime.get().rank}: gradsync.tensorflow.{kind} needs at "
                         f"least one dimension, got the 0-d tensor {tensor!r}; reshape it to (1,)")


def _allgather(tensor: tf.Tensor, name: str | None, process_set: ProcessSet) -> tf.Tensor:
    """One allgather op (dimension 0 may differ between ranks); not differentiable."""
    needs_rows(tensor, "allgather")

    def on_host(array: np.ndarray) -> list[np.ndarray]:
        return [ops.allgather(array, name, process_set)]

    return call_on_host("allgather", on_host, [tensor], [tensor.dtype], [[None] + tensor.shape[1:]],
                        name)[0]


def _alltoall(tensor: tf.Tensor, splits: tf.Tensor | None, name: str | None,
              process_set: ProcessSet) -> tuple[tf.Tensor, tf.Tensor]:
    """One alltoall op: (output, received splits as int32); not differentiable."""
    needs_rows(tensor, "alltoall")

    def on_host(array: np.ndarray, *split: np.ndarray) -> list[np.ndarray]:
        output, received = ops.alltoall(array, split[0] if split else None, name, process_set)
        return [output, np.asarray(received, np.int32)]

    inputs = [tensor] if splits is None else [tensor, splits]
    return tuple(call_on_host("alltoall", on_host, inputs, [tensor.dtype, tf.int32],
                       [[None] + tensor.shape[1:], [process_set.size()]], name))


def allreduce(tensor: Any, average: bool | None = None, device_dense: str = "",
              device_sparse: str = "", compression: Any = Compression.none, op: Any = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0, name: str | None = None,
              process_set: ProcessSet = global_process_set, ignore_name_scope: bool = False) -> Any:
    """Reduce ``tensor`` over the ranks of ``process_set`` (``horovod.tensorflow.allreduce``).

    Args:
        tensor: a ``tf.Tensor`` (or anything ``tf.convert_to_tensor`` takes, a variable included)
            of the same shape and dtype on every rank; a ``tf.IndexedSlices`` is allgathered
            (values and indices), its values divided by the set's size for ``Average``, as Horovod
            does.
        average: Horovod's deprecated form of ``op`` (True: Average, False: Sum).
        device_dense: accepted for Horovod's signature; unused.
        device_sparse: the same.
        compression: ``Compression.none`` (default) or ``Compression.fp16``/``bf16``: the tensor
            crosses the wire in that dtype.
        op: ``Average`` (default), ``Sum``, ``Min``, ``Max``, ``Product`` or ``Adasum``.
        prescale_factor: multiplies the input before the reduction (integers: in float64, then
            truncated back, as Horovod).
        postscale_factor: multiplies the result after it (the same).
        name: the collective's name, the same on every rank (module docstring for unnamed ones).
        process_set: the ranks that take part (default: every rank).
        ignore_name_scope: in a tf.function, do not prefix ``name`` with the current name scope.

    Returns:
        A new ``tf.Tensor`` of the input's shape and dtype (an ``IndexedSlices`` for one).
        Differentiable: the gradient is the same allreduce of the output's gradient.

    Raises:
        ValueError: both ``average`` and ``op``, or an unknown ``op``.
        NotImplementedError: a ``tf.IndexedSlices`` with an op other than Average and Sum, or
            with scale factors (Horovod's).
        tf.errors.FailedPreconditionError: the ranks disagree (shape, dtype, op), when the op
            runs (eagerly, in a tf.function or a TF1 graph, with gradsync's message).
        tf.errors.InvalidArgumentError: a dtype or factor the core refuses, when the op runs.
    """
    op = reduce_op(op, average, "allreduce")
    if isinstance(tensor, tf.IndexedSlices):
        return _sparse_allreduce(tensor, op, name, process_set, prescale_factor, postscale_factor)
    compressed, context = compression.compress(tf.convert_to_tensor(tensor))
    name = collective_name(name, "allreduce", compressed, ignore_name_scope)

    @tf.custom_gradient
    def reduce(x):
        def grad(dy):
            return _allreduce(dy, _grad_name(name), op, prescale_factor, postscale_factor, process_set)
        return _allreduce(x, name, op, prescale_factor, postscale_factor, process_set), grad

    return compression.decompress(reduce(compressed), context)


def _check_sparse(op: ReduceOp, name: str | None, prescale: float, postscale: float) -> None:
    """Raise Horovod's NotImplementedError for an allreduce of IndexedSlices with an op other
    than Average and Sum, or with scale factors."""
    where = f"gradsync: rank {runtime.get().rank}: gradsync.tensorflow.allreduce of IndexedSlices {name!r}"
    if op not in (Average, Sum):
        raise NotImplementedError(f"{where} supports op=Average and Sum, not {op.name}; pass "
                                  "sparse_as_dense=True (or tf.convert_to_tensor the slices) for the others")
    if prescale != 1.0 or postscale != 1.0:
        raise NotImplementedError(f"{where}: prescale_factor={prescale} / postscale_factor={postscale} "
                                  "are not supported with IndexedSlices; convert them to a dense tensor")


def _sparse_allreduce(slices: tf.IndexedSlices, op: ReduceOp, name: str | None, process_set: ProcessSet,
                      prescale: float = 1.0, postscale: float = 1.0) -> tf.IndexedSlices:
    """Horovod's allreduce of IndexedSlices: values and indices allgathered, values divided for
    Average by the divisor the core decided for their allgather (:mod:`gradsync.averaging`); Sum
    and Average only, no scale factors (:func:`_check_sparse`)."""
    _check_sparse(op, name, prescale, postscale)
    values = _gathered_values(tf.convert_to_tensor(slices.values), None if name is None else f"{name}.values",
                              op, process_set)
    indices = allgather(slices.indices, None if name is None else f"{name}.indices",
                        process_set=process_set)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


def _gathered_values(values: tf.Tensor, name: str | None, op: ReduceOp, process_set: ProcessSet) -> tf.Tensor:
    """:func:`allgather` of ``values``, for ``Average`` divided by the core's divisor of that
    allgather (:attr:`gradsync.Handle.divisor`: the set's size, or the ranks that have not joined
    with ``GRADSYNC_JOIN_DIVISOR=contributors``). Differentiable as :func:`allgather`."""
    needs_rows(values, "allgather")
    name = collective_name(name, "allgather", values)

    def on_host(array: np.ndarray) -> list[np.ndarray]:
        handle = ops.allgather_async(array, name, process_set)
        return [handle.wait(), np.asarray(handle.divisor, np.int64)]

    @tf.custom_gradient
    def gather(x):
        gathered, divisor = call_on_host("allgather", on_host, [x], [x.dtype, tf.int64],
                                         [[None] + x.shape[1:], []], name)
        if op != Average:
            return gathered, lambda dy: allgather_grad(x, dy, name, process_set)
        divisor = tf.cast(divisor, gathered.dtype)
        return gathered / divisor, lambda dy: allgather_grad(x, dy / divisor, name, process_set)

    return gather(values)


def grouped_allreduce(tensors: Sequence[Any], average: bool | None = None, device_dense: str = "",
                      device_sparse: str = "", compression: Any = Compression.none, op: Any = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set, name: str | None = None) -> list[Any]:
    """Reduce ``tensors`` as one unit (``horovod.tensorflow.grouped_allreduce``): as
    :func:`allreduce` for each, negotiated together and fused, one core group per dtype.

    Every rank passes the same number of tensors, in the same order, with the same shapes and
    dtypes; a ``tf.IndexedSlices`` among them is allgathered as :func:`allreduce` does.
    ``name`` (gradsync's addition, after Horovod's arguments) names the group; groups of dtype
    ``d`` are named ``<name>.<d>``. Returns a list of new tensors; differentiable (the
    gradient is the same grouped allreduce of the outputs' gradients).

    Raises:
        ValueError: as :func:`allreduce`.
        tf.errors.FailedPreconditionError: as :func:`allreduce`.
    """
    op = reduce_op(op, average, "grouped_allreduce")
    sparse = {i: t for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)}
    if sparse:  # Horovod's: each IndexedSlices allgathered, the dense ones grouped
        for i in sparse:  # checked first, as Horovod does
            _check_sparse(op, None if name is None else f"{name}.sparse.{i}", prescale_factor,
                          postscale_factor)
        dense = [t for i, t in enumerate(tensors) if i not in sparse]
        reduced = iter(grouped_allreduce(dense, compression=compression, op=op, name=name,
                                         prescale_factor=prescale_factor,
                                         postscale_factor=postscale_factor, process_set=process_set))
        return [_sparse_allreduce(t, op, None if name is None else f"{name}.sparse.{i}", process_set,
                                  prescale_factor, postscale_factor)
                if i in sparse else next(reduced) for i, t in enumerate(tensors)]
    compressed = [compression.compress(tf.convert_to_tensor(t)) for t in tensors]
    inputs = [c for c, _ in compressed]
    if not inputs:
        return []
    name = collective_name(name, "grouped_allreduce", inputs[0])

    @tf.custom_gradient
    def reduce(*xs):
        def grad(*dys):
            return grouped_reduce(dys, _grad_name(name), op, prescale_factor, postscale_factor,
                                   process_set)
        return grouped_reduce(xs, name, op, prescale_factor, postscale_factor, process_set), grad

    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduce(*inputs), compressed)]


def allgather(tensor: Any, name: str | None = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Concatenate every rank's ``tensor`` along dimension 0, in rank order
    (``horovod.tensorflow.allgather``; MPI_Allgatherv).

    Dimension 0 may differ between ranks (eagerly and in a tf.function: the output's static
    dimension 0 is unknown); the other dimensions and the dtype must match. Differentiable: the
    gradient is this rank's rows of the averaged output gradient.

    Raises:
        ValueError: a 0-d tensor.
        tf.errors.FailedPreconditionError: the ranks disagree on dtype or trailing shape, as
            :func:`allreduce`.
    """
    tensor = tf.convert_to_tensor(tensor)
    name = collective_name(name, "allgather", tensor, ignore_name_scope)

    @tf.custom_gradient
    def gather(x):
        return _allgather(x, name, process_set), lambda dy: allgather_grad(x, dy, name, process_set)

    return gather(tensor)


def allgather_grad(x: tf.Tensor, dy: tf.Tensor, name: str | None, process_set: ProcessSet) -> tf.Tensor:
    """Horovod's gradient of the allgather of ``x`` named ``name``: this rank's rows of the
    averaged output gradient ``dy``."""
    averaged = _allreduce(dy, _grad_name(name), Average, 1.0, 1.0, process_set)
    rows = _allgather(tf.shape(x, tf.int64)[:1], _grad_name(f"{name}.rows" if name else None),
                      process_set)
    rank = process_set.rank()
    start = tf.reduce_sum(rows[:rank])
    return tf.reshape(averaged[start:start + rows[rank]], tf.shape(x))


def broadcast(tensor: Any, root_rank: int, name: str | None = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """``root_rank``'s ``tensor`` on every rank (``horovod.tensorflow.broadcast``; MPI_Bcast).

    Every rank passes a tensor of the same shape and dtype; ``root_rank`` is a rank of
    ``process_set``. Differentiable: the gradient is the averaged output gradient on the root,
    zeros elsewhere.

    Raises:
        tf.errors.InvalidArgumentError: ``root_rank`` not a rank of the set, when the op runs.
        tf.errors.FailedPreconditionError: the ranks disagree on shape or dtype, as :func:`allreduce`.
    """
    tensor = tf.convert_to_tensor(tensor)
    name = collective_name(name, "broadcast", tensor, ignore_name_scope)

    def run(x: tf.Tensor) -> tf.Tensor:
        def on_host(array: np.ndarray) -> list[np.ndarray]:
            return [ops.broadcast(array, root_rank, name, process_set)]
        return call_on_host("broadcast", on_host, [x], [x.dtype], [x.shape], name)[0]

    @tf.custom_gradient
    def send(x):
        def grad(dy):
            averaged = _allreduce(dy, _grad_name(name), Average, 1.0, 1.0, process_set)
            if process_set.rank() == root_rank:
                return averaged
            with tf.control_dependencies([averaged]):  # a TF1 graph would prune the allreduce
                return tf.zeros_like(averaged)        # here and stall the root's
        return run(x), grad

    return send(tensor)


def alltoall(tensor: Any, splits: Any = None, name: str | None = None, ignore_name_scope: bool = False,
             process_set: ProcessSet = global_process_set) -> tf.Tensor | tuple[tf.Tensor, tf.Tensor]:
    """Send ``splits[r]`` rows of ``tensor`` to each rank r, receive every rank's rows for this one
    (``horovod.tensorflow.alltoall``; MPI_Alltoallv along dimension 0).

    Args:
        tensor: at least one dimension; dimension 0 may differ between ranks.
        splits: ``size`` non-negative integers summing to ``tensor.shape[0]`` (a list or a 1-d
            integer tensor, which may be computed in the graph); None: an even split.

    Returns:
        With ``splits``: ``(output, received_splits)``, the rows received from rank 0, then rank 1,
        ...; and how many came from each rank (int32, shape ``(size,)``). Without: the output
        alone (Horovod's). Differentiable in ``tensor``: the gradient is the alltoall of the
        output's gradient back along the received splits.

    Raises:
        ValueError: a 0-d tensor.
        tf.errors.InvalidArgumentError: bad splits (wrong length, negative, not summing to
            dimension 0), when the op runs.
    """
    tensor = tf.convert_to_tensor(tensor)
    name = collective_name(name, "alltoall", tensor, ignore_name_scope)
    if splits is not None:
        splits = tf.cast(tf.convert_to_tensor(splits), tf.int64)

    @tf.custom_gradient
    def exchange(x):
        output, received = _alltoall(x, splits, name, process_set)

        def grad(d_output, d_received=None):
            back, _ = _alltoall(d_output, tf.cast(received, tf.int64), _grad_name(name), process_set)
            return tf.reshape(back, tf.shape(x))
        return (output, received), grad

    output, received = exchange(tensor)
    return output if splits is None else (output, received)


def reducescatter(tensor: Any, device_dense: str = "", compression: Any = Compression.none,
                  op: Any = Average, name: str | None = None,
                  process_set: ProcessSet = global_process_set, ignore_name_scope: bool = False,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> tf.Tensor:
    """Reduce ``tensor`` over the ranks and return this rank's block of rows
    (``horovod.tensorflow.reducescatter``): rank r of the set gets ``N // size`` rows, plus one if
    ``r < N % size``, of the reduction of the ``N``-row tensors.

    ``op`` is ``Average`` (default) or ``Sum`` (and Min, Max, Product); the other arguments as
    :func:`allreduce`. Differentiable: the gradient is the allgather of the output's gradient,
    times the set's size for ``Sum`` and times the scale factors (Horovod's).

    Raises:
        ValueError: a 0-d tensor, an unknown ``op``.
        tf.errors.FailedPreconditionError: as :func:`allreduce`.
    """
    op = reduce_op(op, None, "reducescatter")
    compressed, context = compression.compress(tf.convert_to_tensor(tensor))
    needs_rows(compressed, "reducescatter")
    name = collective_name(name, "reducescatter", compressed, ignore_name_scope)

    def run(x: tf.Tensor) -> tf.Tensor:
        def on_host(array: np.ndarray) -> list[np.ndarray]:
            return start_reduction(lambda xs, o, pre, post: ops.reducescatter_async(
                xs[0], name, o, pre, post, process_set), [array], op, prescale_factor, postscale_factor)()
        return call_on_host("reducescatter", on_host, [x], [x.dtype], [[None] + x.shape[1:]], name)[0]

    @tf.custom_gradient
    def scatter(x):
        return run(x), lambda dy: reducescatter_grad(dy, name, op, prescale_factor, postscale_factor,
                                                     process_set)

    return compression.decompress(scatter(compressed), context)


def reducescatter_grad(dy: tf.Tensor, name: str | None, op: ReduceOp, prescale: float, postscale: float,
                       process_set: ProcessSet) -> tf.Tensor:
    """Horovod's gradient of the reducescatter named ``name``: the allgather of the output
    gradient ``dy``, times the set's size for ``Sum`` and times the scale factors."""
    factor = prescale * postscale * (process_set.size() if op == Sum else 1)
    return _allgather(dy * tf.cast(factor, dy.dtype) if factor != 1 else dy, _grad_name(name), process_set)
