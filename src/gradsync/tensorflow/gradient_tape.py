"""Data-parallel training with TensorFlow: :func:`DistributedGradientTape`,
:func:`PartialDistributedGradientTape`, :func:`allreduce_gradients` and :func:`broadcast_variables`
(``horovod.tensorflow``'s names and arguments).

A distributed tape is the user's ``tf.GradientTape`` whose ``gradient()`` returns every rank's
gradients averaged: dense gradients go through one grouped allreduce per dtype (negotiated and
fused as one unit, so their order in the graph does not matter), ``tf.IndexedSlices`` through an
allgather of values and indices (or densified first with ``sparse_as_dense=True``), as Horovod
does. It works eagerly and inside ``tf.function``.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence
from typing import Any

import tensorflow as tf

from ..averaging import local_gradient_divisor, predivide_scales
from ..engine.protocol import ReduceOp
from ..process import runtime
from ..process_sets import ProcessSet, global_process_set
from .compression import Compression
from .mpi_ops import Average, Sum, allreduce, grouped_allreduce, reduce_op


def _group_name(gradients: Sequence[tf.Tensor], prefix: str) -> str:
    """A name for the grouped allreduce of ``gradients``: the same on every rank (same shapes and
    dtypes in the same order) and at every step, different for another set of variables."""
    layout = ";".join(f"{g.dtype.name}{g.shape}" for g in gradients)
    return f"{prefix}.{len(gradients)}.{zlib.crc32(layout.encode()):08x}"


def allreduce_gradients(gradients: Sequence[Any], op: Any = Average, compression: Any = Compression.none,
                        sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                        process_set: ProcessSet = global_process_set,
                        name: str = "gradients") -> list[Any]:
    """Every rank's ``gradients`` reduced, in the same order; None stays None.

    The building block of :class:`DistributedGradientTape` (and of gradsync.keras on the
    TensorFlow backend). Dense gradients: one grouped allreduce per dtype; ``tf.IndexedSlices``:
    densified (``sparse_as_dense``) or allgathered, values divided for Average by the divisor the
    core decided for that allgather (:mod:`gradsync.averaging`: the set's size, or the ranks that
    have not joined with ``GRADSYNC_JOIN_DIVISOR=contributors``), as the dense ones are.

    Args:
        gradients: ``tf.Tensor``, ``tf.IndexedSlices`` or None, the same list on every rank (a
            None on one rank and a tensor on another is a disagreement between ranks).
        op: ``Average`` (default), ``Sum`` or ``Adasum``.
        compression: ``Compression.none``, ``fp16`` or ``bf16`` (dense gradients).
        sparse_as_dense: convert ``IndexedSlices`` to dense tensors before reducing.
        gradient_predivide_factor: Horovod's: with ``Average``, divide by this before the sum and
            by ``divisor / factor`` after it (same result, other rounding;
            :func:`gradsync.averaging.predivide_scales`). Sparse gradients are allgathered, not
            summed: they are averaged without it.
        process_set: the ranks that take part.
        name: the prefix of the collectives' names.

    Raises:
        ValueError: an op other than Average, Sum, Adasum; a predivide factor with another op.
    """
    op = reduce_op(op, None, "allreduce_gradients")
    where = f"gradsync: rank {runtime.get().rank}: gradsync.tensorflow.allreduce_gradients"
    if op not in (Average, Sum, ReduceOp.Adasum):
        raise ValueError(f"{where}: op={op.name}; gradients are reduced with Average, Sum or Adasum")
    prescale, postscale = predivide_scales(op, gradient_predivide_factor, where)
    grads = [tf.convert_to_tensor(g) if sparse_as_dense and isinstance(g, tf.IndexedSlices) else g
             for g in gradients]
    return reduce_gradients(grads, op, prescale, postscale, compression, process_set, name)


def reduce_gradients(grads: Sequence[Any], op: ReduceOp, prescale: float, postscale: float,
                     compression: Any, process_set: ProcessSet, name: str) -> list[Any]:
    """:func:`allreduce_gradients` once its arguments are checked (what gradsync.keras's
    TensorFlow backend calls too): the dense gradients in one grouped allreduce per dtype with
    the scale factors; each ``tf.IndexedSlices`` allgathered and, for Average, divided by the
    core's divisor of that allgather. Nothing is summed there, so the factors (a split of the
    division around a sum, :func:`gradsync.averaging.predivide_scales`) do not apply to it."""
    dense = [i for i, g in enumerate(grads) if g is not None and not isinstance(g, tf.IndexedSlices)]
    out = list(grads)
    members = [grads[i] for i in dense]
    reduced = grouped_allreduce(members, compression=compression, op=op, prescale_factor=prescale,
                                postscale_factor=postscale, process_set=process_set,
                                name=_group_name(members, name)) if members else []
    out_dense = dict(zip(dense, reduced))
    for i, g in enumerate(grads):
        if i in out_dense:
            out[i] = out_dense[i]
        elif isinstance(g, tf.IndexedSlices):
            out[i] = allreduce(g, op=Average if op == Average else Sum, name=f"{name}.sparse.{i}",
                               process_set=process_set)
    return out


class _DistributedGradientTape(tf.GradientTape):
    """A ``tf.GradientTape`` whose :meth:`gradient` returns the reduced gradients; built by
    :func:`DistributedGradientTape` from the user's tape, whose recording it shares."""

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 unconnected_gradients: Any = tf.UnconnectedGradients.NONE) -> Any:
        """``tf.GradientTape.gradient``, then every rank's gradients averaged (or reduced with the
        tape's op) as :func:`allreduce_gradients` does; the gradients of the variables registered
        with :meth:`register_local_source` are not reduced, but divided by the set's size
        (Horovod's ``scale_local_gradients``). Returns the structure of ``sources``."""
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients)
        flat_sources, flat = tf.nest.flatten(sources), tf.nest.flatten(grads)
        shared = [i for i, s in enumerate(flat_sources) if id(s) not in self._gradsync_local]
        reduced = allreduce_gradients([flat[i] for i in shared], **self._gradsync_args)
        out = [self._scale_local(g) for g in flat]
        for i, g in zip(shared, reduced):
            out[i] = g
        return tf.nest.pack_sequence_as(grads, out)

    def register_local_source(self, source: Any) -> None:
        """Exclude ``source`` (a variable) from the reduction: its gradient stays this rank's own
        (divided by the set's size). Every rank must register the same sources."""
        self._gradsync_local.add(id(source))

    def _scale_local(self, grad: Any) -> Any:
        if grad is None or not self._gradsync_local:
            return grad
        size = local_gradient_divisor(self._gradsync_args["process_set"])
        if isinstance(grad, tf.IndexedSlices):
            return tf.IndexedSlices(grad.values / size, grad.indices, grad.dense_shape)
        return grad / tf.cast(size, grad.dtype)


def DistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "",  # noqa: N802 - Horovod's name
                            device_sparse: str = "", compression: Any = Compression.none,
                            sparse_as_dense: bool = False, op: Any = Average,
                            gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                            groups: Any = None, process_set: ProcessSet = global_process_set,
                            scale_local_gradients: bool = True) -> tf.GradientTape:
    """``gradtape`` as a tape whose ``gradient()`` averages every rank's gradients
    (``horovod.tensorflow.DistributedGradientTape``)::

        with tf.GradientTape() as tape:
            loss = loss_fn(model(x), y)
        tape = gradsync.tensorflow.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)

    It may also wrap a tape before recording (``with DistributedGradientTape(tf.GradientTape())
    as tape:``). The result is a ``tf.GradientTape`` (a subclass) sharing ``gradtape``'s
    recording; ``gradtape`` itself is unchanged.

    ``compression``, ``sparse_as_dense``, ``op``, ``gradient_predivide_factor`` and
    ``process_set`` are those of :func:`allreduce_gradients`; ``device_dense``, ``device_sparse``,
    ``num_groups`` and ``groups`` are accepted for Horovod's signature (gradsync fuses every dense
    gradient of a dtype into one group already).

    Args:
        gradtape: the ``tf.GradientTape`` to wrap.
        scale_local_gradients: divide the gradients of local sources
            (:func:`PartialDistributedGradientTape`) by the set's size (Horovod's default True).

    Raises:
        TypeError: ``gradtape`` is not a ``tf.GradientTape``.
        ValueError: as :func:`allreduce_gradients`.
    """
    if not isinstance(gradtape, tf.GradientTape):
        raise TypeError(f"gradsync: rank {runtime.get().rank}: DistributedGradientTape wraps a "
                        f"tf.GradientTape, not a {type(gradtape).__name__}")
    reduce_op(op, None, "DistributedGradientTape")  # an unknown op fails here, not at gradient()
    tape = _DistributedGradientTape.__new__(_DistributedGradientTape)
    tape.__dict__.update(gradtape.__dict__)
    tape._gradsync_args = {"op": op, "compression": compression, "sparse_as_dense": sparse_as_dense,
                           "gradient_predivide_factor": gradient_predivide_factor,
                           "process_set": process_set, "name": "DistributedGradientTape"}
    tape._gradsync_local = set()
    if not scale_local_gradients:
        tape._scale_local = lambda grad: grad
    return tape


def PartialDistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "",  # noqa: N802
                                   device_sparse: str = "", compression: Any = Compression.none,
                                   sparse_as_dense: bool = False, op: Any = Average,
                                   gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                                   groups: Any = None, process_set: ProcessSet = global_process_set,
                                   local_layers: Iterable[Any] | None = None,
                                   scale_local_gradients: bool = True) -> tf.GradientTape:
    """A :func:`DistributedGradientTape` that leaves the gradients of ``local_layers``' trainable
    weights unreduced (divided by the set's size when ``scale_local_gradients``)
    (``horovod.tensorflow.PartialDistributedGradientTape``): for layers each rank trains on its own.

    ``local_layers``: Keras layers (anything with ``trainable_weights``), or a single one; every
    rank passes the same. Other arguments as :func:`DistributedGradientTape`.
    """
    tape = DistributedGradientTape(gradtape, compression=compression, sparse_as_dense=sparse_as_dense,
                                   op=op, gradient_predivide_factor=gradient_predivide_factor,
                                   process_set=process_set, scale_local_gradients=scale_local_gradients)
    if local_layers is not None and hasattr(local_layers, "trainable_weights"):
        local_layers = [local_layers]
    for layer in local_layers or ():
        for variable in layer.trainable_weights:
            tape.register_local_source(variable)
    return tape
