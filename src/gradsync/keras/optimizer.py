"""DistributedOptimizer for Keras 3 optimizers, broadcast_variables and load_model.

The wrapped optimizer is an instance of a dynamic subclass of the given optimizer's class (as
Horovod's ``horovod.tensorflow.keras.DistributedOptimizer``), rebuilt from its ``get_config()``:
``get_config``/``from_config`` and saving keep working. Its ``apply`` (which ``apply_gradients``
and every Keras backend's train step call) averages the gradients across ranks before the wrapped
optimizer's own ``apply`` clips them and updates the variables. The averaging itself is the
backend adapter's (:mod:`gradsync.keras._jax`, ``_torch``, ``_tensorflow``): one small module per
Keras backend.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np

from .. import naming, ops
from ..averaging import local_gradient_divisor, predivide_scales
from ..compression import CastCompressor, Compression, Compressor
from ..engine.protocol import ReduceOp
from ..process import runtime
from ..process_sets import ProcessSet, global_process_set

#: Keras backend -> the gradsync module that reduces that backend's tensors inside its train step.
BACKEND_MODULES = {"jax": "gradsync.keras._jax", "torch": "gradsync.keras._torch",
                   "tensorflow": "gradsync.keras._tensorflow"}


def backend_ops() -> Any:
    """The adapter module of the running Keras backend (``keras.backend.backend()``).

    Raises:
        NotImplementedError: a backend gradsync has no adapter for (numpy, openvino).
    """
    backend = keras.backend.backend()
    if backend not in BACKEND_MODULES:
        raise NotImplementedError(f"gradsync: rank {runtime.get().rank}: gradsync.keras supports the Keras "
                                  f"backends {sorted(BACKEND_MODULES)}, not KERAS_BACKEND={backend!r}")
    return importlib.import_module(BACKEND_MODULES[backend])


class _KerasCast(CastCompressor):
    """gradsync's 16-bit cast compressors on ``keras.ops``: the same rule (float32/float64 travel
    as ``dtype``), on any backend's tensors, traced ones (under ``jax.jit``) included."""

    def compress(self, tensor: Any) -> tuple[Any, Any]:
        original = keras.backend.standardize_dtype(tensor.dtype)
        if original not in ("float32", "float64"):
            return tensor, None
        return keras.ops.cast(tensor, self.dtype), original

    def decompress(self, tensor: Any, context: Any) -> Any:
        return tensor if context is None else keras.ops.cast(tensor, context)


def _for_keras(compression: Compressor) -> Compressor:
    """The compressor to run inside the train step: built-in casts through keras.ops, others as given."""
    return _KerasCast(compression.dtype) if type(compression) is CastCompressor else compression


@dataclass(frozen=True)
class _Settings:
    name: str
    compression: Compressor
    op: ReduceOp
    passes: int  # backward passes per step (Keras's gradient_accumulation_steps)
    average_aggregated: bool
    process_set: ProcessSet
    sparse_as_dense: bool = False
    scales: tuple[float, float] = (1.0, 1.0)  # (prescale, postscale) of gradient_predivide_factor


class _Distributed:
    """The mixin put before the wrapped optimizer's class: averages gradients in ``apply``."""

    _gradsync: _Settings

    def apply(self, grads: Any, trainable_variables: Any = None) -> Any:
        """Average ``grads`` across ranks (every k-th pass only, with k backward passes per step),
        then run the wrapped optimizer's ``apply``; see :func:`DistributedOptimizer`."""
        grads = list(grads)
        if trainable_variables is not None and not self.built:
            self.build(list(trainable_variables))
        variables = list(self._trainable_variables if trainable_variables is None else trainable_variables)
        local = getattr(self, "_gradsync_local", frozenset())
        present = [i for i, g in enumerate(grads) if g is not None and id(variables[i]) not in local]
        if present:
            given = [grads[i] for i in present]
            if self._gradsync.passes > 1:
                reduced = self._reduce_every_kth(given, [variables[i] for i in present])
            else:
                reduced = self._reduce(given)
            for i, g in zip(present, reduced):
                grads[i] = g
        if local and getattr(self, "_gradsync_scale_local", True):  # Horovod's: divided by the size
            size = float(local_gradient_divisor(self._gradsync.process_set))
            grads = [g / size if g is not None and id(v) in local else g for g, v in zip(grads, variables)]
        return super().apply(grads, trainable_variables)

    def register_local_var(self, var: Any) -> None:
        """Keep ``var``'s gradient local: not reduced, divided by the size of the process set
        (unless ``scale_local_gradients=False``), as Horovod's ``register_local_var``. Every rank
        must register the same variables (which gradients are reduced must agree across ranks)."""
        self._gradsync_local = getattr(self, "_gradsync_local", frozenset()) | {id(var)}

    def _reduce(self, grads: list[Any]) -> list[Any]:
        settings = self._gradsync
        if settings.sparse_as_dense:
            grads = backend_ops().densify(grads)
        compressed, contexts = zip(*[settings.compression.compress(g) for g in grads])
        reduced = backend_ops().grouped_allreduce(list(compressed), f"{settings.name}.gradients",
                                                  settings.op, settings.process_set, *settings.scales)
        return [settings.compression.decompress(g, c) for g, c in zip(reduced, contexts)]

    def _reduce_every_kth(self, grads: list[Any], variables: list[Any]) -> list[Any]:
        """With Keras's gradient accumulation over k passes, communicate on the k-th pass only.

        Keras then applies ``(g + acc) / k`` (``acc``: the sum of the k-1 earlier passes); returning
        ``R * s - acc``, with ``R`` the allreduce of the local sums ``g + acc``, makes that ``R / k``
        (``s = 1``, averaged aggregation) or ``R`` (``s = k``, Horovod's default). The condition
        depends on the iteration counter only, which is the same on every rank.
        """
        k = self._gradsync.passes
        accumulated = [self._accumulated_gradients[self._get_variable_index(v)] for v in variables]
        scale = 1 if self._gradsync.average_aggregated else k

        def communicate() -> list[Any]:
            sums = [g + a.value for g, a in zip(grads, accumulated)]
            return [r * scale - a.value for r, a in zip(self._reduce(sums), accumulated)]

        return keras.ops.cond((self._iterations + 1) % k == 0, communicate, lambda: list(grads))


def _distributed_class(base: type, settings: _Settings) -> type:
    """A subclass of the optimizer class ``base`` whose instances average gradients first."""
    return type(base.__name__, (_Distributed, base), {"_gradsync": settings, "__module__": base.__module__,
                                                      "__doc__": base.__doc__})


def DistributedOptimizer(optimizer: Any, name: str | None = None,  # noqa: N802
                         device_dense: str = "", device_sparse: str = "",
                         compression: Compressor = Compression.none, sparse_as_dense: bool = False,
                         gradient_predivide_factor: float = 1.0, op: ReduceOp = ReduceOp.Average,
                         backward_passes_per_step: int = 1, average_aggregated_gradients: bool = False,
                         num_groups: int = 0, groups: Any = None,
                         process_set: ProcessSet = global_process_set) -> Any:
    """A Keras 3 optimizer that averages the gradients across ranks before every update
    (``horovod.tensorflow.keras.DistributedOptimizer``, any backend; long form: docs/keras.md).

    All gradients of a step are one grouped allreduce of the backend's adapter, inside
    ``model.fit``'s compiled train step, before the optimizer's clipping and loss-scale handling,
    as in Horovod: N ranks with batch B each take the same steps as one process with batch N*B.
    The arguments are Horovod's, in its order; ``device_dense``, ``device_sparse``, ``num_groups``
    and ``groups`` are accepted and change nothing (a step's gradients are fused as one group).

    Args:
        optimizer: a Keras 3 optimizer, not yet built (wrap it before ``compile``).
        name: the collectives' name prefix (default ``"Distributed<Class>"``); the same on every rank.
        compression: ``Compression.none`` (default), ``fp16`` or ``bf16``, or any
            :class:`gradsync.Compressor` working on the backend's tensors.
        sparse_as_dense: densify the TensorFlow backend's ``tf.IndexedSlices`` gradients (else they
            are allgathered, as Horovod does; the other backends' gradients are dense).
        gradient_predivide_factor: Horovod's split of the averaging around the sum (needs
            ``op=Average``; :func:`gradsync.averaging.predivide_scales`).
        op: ``Average`` (default) or ``Sum``.
        backward_passes_per_step: k >= 1: accumulate k passes (Keras's own
            ``gradient_accumulation_steps``, which it sets) and communicate on every k-th only; the
            update uses the sum of the k averaged gradients. An optimizer built with
            ``gradient_accumulation_steps=k`` is treated as k passes with averaging (Keras's).
        average_aggregated_gradients: with k > 1, the mean of the k averaged gradients instead.
        process_set: the ranks that average their gradients (default: every rank).

    Returns:
        A new optimizer of a subclass of ``type(optimizer)``, with the same config.

    Raises:
        ValueError: ``backward_passes_per_step`` < 1, or > 1 on an optimizer that already has a
            different ``gradient_accumulation_steps``; ``gradient_predivide_factor`` != 1 with an
            ``op`` other than Average.
        NotImplementedError (when training): a Keras backend without a gradsync adapter.
    """
    scales = predivide_scales(op, gradient_predivide_factor,
                              f"gradsync: rank {runtime.get().rank}: DistributedOptimizer")
    config = optimizer.get_config()
    passes, average = _passes(config, backward_passes_per_step, average_aggregated_gradients)
    base = _unwrapped(type(optimizer))
    settings = _Settings(name or f"Distributed{base.__name__}", _for_keras(compression), ReduceOp(op),
                         passes, average, process_set, sparse_as_dense, scales)
    return _distributed_class(base, settings).from_config(config)


def _unwrapped(base: type) -> type:
    """The optimizer class under gradsync's subclasses: wrapping twice would average twice."""
    while issubclass(base, _Distributed):
        base = base.__mro__[2]
    return base


def PartialDistributedOptimizer(optimizer: Any, name: str | None = None,  # noqa: N802
                                device_dense: str = "", device_sparse: str = "",
                                compression: Compressor = Compression.none, sparse_as_dense: bool = False,
                                gradient_predivide_factor: float = 1.0, op: ReduceOp = ReduceOp.Average,
                                backward_passes_per_step: int = 1, average_aggregated_gradients: bool = False,
                                groups: Any = None, process_set: ProcessSet = global_process_set,
                                local_layers: Any = None, scale_local_gradients: bool = True) -> Any:
    """:func:`DistributedOptimizer` whose ``local_layers`` (a Keras layer or a list of them) keep
    their gradients local (``horovod.keras.PartialDistributedOptimizer``): not reduced, and
    divided by the size of ``process_set`` unless ``scale_local_gradients=False`` (Horovod's rule).
    The other arguments are DistributedOptimizer's. Every rank must name the same layers.

    Raises:
        ValueError: an element of ``local_layers`` is not a ``keras.layers.Layer``; the errors of
            :func:`DistributedOptimizer`.
    """
    layers = [] if local_layers is None else (
        [local_layers] if isinstance(local_layers, keras.layers.Layer) else list(local_layers))
    if not all(isinstance(layer, keras.layers.Layer) for layer in layers):
        raise ValueError(f"gradsync: rank {runtime.get().rank}: PartialDistributedOptimizer: local_layers "
                         f"must be Keras layers, got {[type(layer).__name__ for layer in layers]}")
    wrapped = DistributedOptimizer(optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
                                   gradient_predivide_factor, op, backward_passes_per_step,
                                   average_aggregated_gradients, 0, groups, process_set)
    wrapped._gradsync_scale_local = scale_local_gradients
    for layer in layers:
        for variable in layer.trainable_weights:
            wrapped.register_local_var(variable)
    return wrapped


def _passes(config: dict, backward_passes_per_step: int, average: bool) -> tuple[int, bool]:
    """(k, average the k-pass sum) from the arguments and the optimizer's own accumulation; sets
    ``gradient_accumulation_steps`` in ``config`` to k when k > 1."""
    accumulation = config.get("gradient_accumulation_steps") or 1
    if backward_passes_per_step < 1 or backward_passes_per_step > 1 and accumulation not in (
            1, backward_passes_per_step):
        raise ValueError(f"gradsync: rank {runtime.get().rank}: DistributedOptimizer: "
                         f"backward_passes_per_step={backward_passes_per_step} must be >= 1 and agree with "
                         f"the optimizer's gradient_accumulation_steps={accumulation}")
    passes = max(backward_passes_per_step, accumulation)
    if passes > 1:
        config["gradient_accumulation_steps"] = passes
    return passes, average or (backward_passes_per_step == 1 and accumulation > 1)


def broadcast_variables(variables: Any, root_rank: int = 0, name: str = "broadcast_variables",
                        process_set: ProcessSet = global_process_set) -> None:
    """Assign ``root_rank``'s values of ``variables`` (Keras variables) to them on every rank
    (``horovod.tensorflow.keras.broadcast_variables``).

    Each variable is copied to host memory (``keras.ops.convert_to_numpy``), broadcast (MPI_Bcast
    semantics, named ``<name>.<index>``: Keras 3 names every Dense layer's weight ``kernel``, and
    Keras numbers layers per process, so the position alone names a variable; all started before
    any is waited on) and assigned back.

    Raises:
        ValueError: ``root_rank`` is not a rank (of ``process_set``); the ranks pass different
            numbers of variables (checked first, in one small allgather: the message lists each
            rank's count, on every rank).
        gradsync.CollectiveError: the ranks' variables differ in shape or dtype (the message
            names the variable and each rank's value).
    """
    variables = list(variables)
    counts = ops.allgather(np.array([len(variables)], dtype=np.int64), name=f"{name}.count",
                           process_set=process_set).tolist()
    if len(set(counts)) > 1:
        listed = ", ".join(f"rank {r}: {n}" for r, n in zip(process_set.ranks, counts))
        raise ValueError(f"gradsync: rank {runtime.get().rank}: {name}: the ranks pass different numbers "
                         f"of variables ({listed}); every rank must pass the same variables (a model or "
                         "optimizer built on some ranks only, e.g. loaded from a checkpoint on one rank, "
                         "has more: broadcast after the first train step, as "
                         "BroadcastGlobalVariablesCallback does then)")
    values = [keras.ops.convert_to_numpy(v) for v in variables]
    # By position only: the call waits before it returns, so nothing else of this name is in
    # flight, and variable names may differ by rank (Keras numbers layers per process).
    names = naming.indexed(name, [None] * len(variables))
    handles = [ops.broadcast_async(np.ascontiguousarray(value), root_rank, name=member,
                                   process_set=process_set) for member, value in zip(names, values)]
    for variable, value, handle in zip(variables, values, handles):
        variable.assign(handle.wait().reshape(value.shape))  # 0-d values travel as shape (1,)


def load_model(filepath: str, custom_optimizers: list[type] | None = None,
               custom_objects: dict[str, Any] | None = None, compression: Compressor = Compression.none,
               legacy_opts: bool = False, **kwargs: Any) -> Any:
    """Load a model saved with a DistributedOptimizer, its optimizer wrapped again
    (``horovod.tensorflow.keras.load_model``).

    Every optimizer class of ``keras.optimizers`` and of ``custom_optimizers`` is mapped, by class
    name, to its distributed subclass (with ``compression``, other settings at their defaults);
    ``custom_objects`` and ``kwargs`` go to ``keras.models.load_model``. ``legacy_opts`` (Horovod's
    switch to ``tf.keras.optimizers.legacy``) must be False: Keras 3 has no legacy optimizers.

    Raises:
        ValueError: ``legacy_opts=True``; and what ``keras.models.load_model`` raises (a missing
            file, an unknown class).
    """
    if legacy_opts:
        raise ValueError(f"gradsync: rank {runtime.get().rank}: load_model(legacy_opts=True): Keras 3 has "
                         "no legacy optimizers (keras.optimizers.legacy)")
    classes = [c for c in vars(keras.optimizers).values()
               if isinstance(c, type) and issubclass(c, keras.optimizers.Optimizer)]
    wrapped = {}
    for base in classes + list(custom_optimizers or []):
        settings = _Settings(f"Distributed{base.__name__}", _for_keras(compression), ReduceOp.Average,
                             1, False, global_process_set)
        wrapped[base.__name__] = _distributed_class(base, settings)
    return keras.models.load_model(filepath, custom_objects={**wrapped, **(custom_objects or {})}, **kwargs)
