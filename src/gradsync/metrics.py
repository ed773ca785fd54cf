"""Averaging metrics across ranks for logging: loss, accuracy, any scalar or small array.

Each rank computes its metrics on its own shard of the data; a log line should show the value over
all ranks. These helpers do that with one collective per read, on python and numpy values (a CPU
torch scalar tensor works too, through ``numpy.asarray``), and return python floats (or numpy
arrays) that are identical on every rank::

    loss = gradsync.metrics.Metric("train_loss")
    for x, y in batches:
        ...
        loss.update(batch_loss.item(), weight=len(y))   # local: no communication
    print(loss.compute())                               # collective: every rank calls it

Every function here is a collective: every rank must call it, in the same order, with the same
name (see :mod:`gradsync.ops`). This module imports no deep-learning framework.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from . import ops
from .engine.protocol import ReduceOp
from .process import runtime

__all__ = ["Metric", "allreduce_scalar", "average_scalars"]


def _where(what: str, name: str | None) -> str:
    label = "(unnamed)" if name is None else repr(name)
    return f"gradsync: rank {runtime.get().rank}: {what} {label}"


def _as_float64(value: Any, where: str) -> np.ndarray:
    """``value`` as a float64 numpy array, or a TypeError naming it."""
    try:
        array = np.asarray(value)
    except (TypeError, ValueError, RuntimeError) as exc:  # e.g. a torch tensor that requires grad
        raise TypeError(f"{where}: value {value!r} cannot be read as numbers: {exc}") from None
    if array.dtype.kind not in "biuf":
        raise TypeError(f"{where}: value {value!r} is not a real number or an array of them "
                        f"(dtype {array.dtype})")
    return array.astype(np.float64)


def allreduce_scalar(value: Any, name: str | None = None, op: ReduceOp = ReduceOp.Average) -> float:
    """Reduce one number across ranks and return the result as a python float on every rank.

    Args:
        value: a real scalar: python ``int``/``float``/``bool``, a numpy scalar or 0-d array, or a
            0-d CPU torch tensor without grad (use ``loss.item()`` or ``loss.detach()``).
        name: identifies the collective across ranks, as for :func:`gradsync.allreduce`.
        op: ``Average`` (default), ``Sum``, ``Min``, ``Max`` or ``Product``. The reduction runs in
            float64, so the average of integers is their exact mean, not its floor.

    Returns:
        The reduced value as a python ``float``, the same on every rank.

    Raises:
        NotInitializedError: before ``gradsync.init()``.
        TypeError: ``value`` is not a real scalar (the message names the collective and the rank).
        ValueError: ``op`` is not a ``ReduceOp``.
        CollectiveError: ranks disagreed on ``op``.
    """
    where = _where("allreduce_scalar", name)
    array = _as_float64(value, where)
    if array.ndim != 0:
        raise TypeError(f"{where}: value has shape {array.shape}, not a scalar; use gradsync.allreduce "
                        "for arrays")
    return float(ops.allreduce(array.reshape(1), name=name, op=op)[0])


def average_scalars(values: Mapping[str, Any], name: str | None = None) -> dict[str, float]:
    """Average several named scalars across ranks at once; one collective for all of them.

    Every rank passes the same keys (in any order). The result maps each key to the mean of its
    value over all ranks, in float64, as a python ``float``, the same on every rank. The values
    are gathered (one ``allgather`` of ``len(values) + 1`` float64 per rank) and summed in rank
    order, so a different key set on some rank is detected instead of averaging unrelated numbers.

    Args:
        values: key -> real scalar (as for :func:`allreduce_scalar`); may be empty.
        name: identifies the collective across ranks, as for :func:`gradsync.allgather`.

    Returns:
        A new dict with the keys in sorted order.

    Raises:
        NotInitializedError: before ``gradsync.init()``.
        TypeError: ``values`` is not a mapping with string keys, or a value is not a real scalar.
        ValueError: the ranks passed different key sets (raised on every rank; lists each rank's
            keys).
        CollectiveError: the ranks passed different numbers of keys.
    """
    where = _where("average_scalars", name)
    if not isinstance(values, Mapping) or not all(isinstance(k, str) for k in values):
        raise TypeError(f"{where}: values must be a mapping of str keys to scalars, not {values!r}")
    keys = sorted(values)
    row = np.empty((1, len(keys) + 1), np.float64)
    row[0, 0] = zlib.crc32("\0".join(keys).encode())  # < 2**32: exact in float64
    for i, key in enumerate(keys):
        scalar = _as_float64(values[key], f"{where}: key {key!r}")
        if scalar.ndim != 0:
            raise TypeError(f"{where}: key {key!r} has shape {scalar.shape}, not a scalar")
        row[0, i + 1] = scalar
    rows = ops.allgather(row, name=name)
    if np.any(rows[:, 0] != row[0, 0]):
        every = ops.allgather_object(keys, name=f"{name or 'average_scalars'}.keys")
        listing = ", ".join(f"rank {r}: {k}" for r, k in enumerate(every))
        raise ValueError(f"{where}: ranks passed different keys: {listing}")
    return dict(zip(keys, (float(v) for v in rows[:, 1:].sum(axis=0) / rows.shape[0])))


class Metric:
    """A weighted mean accumulated locally over steps and averaged across ranks when read.

    ``update`` is local and cheap; ``compute`` is one allreduce (a collective: every rank calls it
    at the same point, with the same number of earlier ``compute`` calls of this metric). The
    result is the weighted mean over every update on every rank,
    ``sum(value * weight) / sum(weight)``, so shards and batches of different sizes count in
    proportion to their weight (pass the batch size as ``weight`` for per-sample means). A rank
    without updates contributes nothing. Arithmetic is float64.

    Args:
        name: the metric's name; its collective is named ``metric.<name>``, so each metric needs a
            name of its own.
        shape: the shape of every value: ``()`` (default) for scalars, e.g. ``(10,)`` for a
            per-class accuracy vector. The same on every rank.

    Raises:
        TypeError: ``name`` is not a non-empty string, or ``shape`` not a tuple of ints >= 0.
    """

    def __init__(self, name: str, shape: tuple[int, ...] = ()) -> None:
        if not isinstance(name, str) or not name:
            raise TypeError(f"gradsync: Metric name must be a non-empty str, not {name!r}")
        if not isinstance(shape, tuple) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise TypeError(f"gradsync: Metric {name!r}: shape must be a tuple of ints >= 0, "
                            f"not {shape!r}")
        self.name = name
        self.shape = shape
        self.reset()

    def reset(self) -> None:
        """Forget every update on this rank (local; call it on every rank, e.g. each epoch)."""
        self._weighted_sum = np.zeros(self.shape, np.float64)
        self._weight = 0.0

    def update(self, value: Any, weight: float = 1.0) -> None:
        """Add ``value`` (a mean over ``weight`` samples) on this rank; no communication.

        Args:
            value: real numbers of the metric's shape: a python or numpy scalar, a 0-d CPU torch
                tensor without grad, or (for a non-scalar metric) an array of that shape.
            weight: how much ``value`` counts, finite and >= 0 (e.g. the batch size).

        Raises:
            NotInitializedError: before ``gradsync.init()``.
            TypeError: ``value`` is not real numbers.
            ValueError: ``weight`` is negative or not finite; ``value`` has another shape than
                the metric's.
        """
        where = _where("Metric", self.name)
        array = _as_float64(value, where)
        weight = float(weight)
        if not (np.isfinite(weight) and weight >= 0):
            raise ValueError(f"{where}: weight={weight!r} must be finite and >= 0")
        if array.shape != self.shape:
            raise ValueError(f"{where}: value has shape {array.shape}, but the metric's shape is "
                             f"{self.shape}")
        self._weighted_sum += array * weight
        self._weight += weight

    @property
    def local_weight(self) -> float:
        """The total weight of this rank's updates since the last ``reset`` (local)."""
        return self._weight

    def compute(self) -> float | np.ndarray:
        """The weighted mean over every rank's updates since their last ``reset``; a collective.

        One allreduce (``Sum``) of the metric's weighted sums and weight, ``prod(shape) + 1``
        float64 values, named ``metric.<name>``.

        Returns:
            A python ``float`` for a scalar metric, else a new float64 numpy array of the metric's
            shape; the same on every rank.

        Raises:
            NotInitializedError: before ``gradsync.init()``.
            ValueError: the total weight over all ranks is 0 (no updates anywhere); raised on every
                rank alike.
            CollectiveError: ranks declared the metric with different shapes.
        """
        local = np.append(self._weighted_sum.ravel(), self._weight)
        total = ops.allreduce(local, name=f"metric.{self.name}", op=ReduceOp.Sum)
        if total[-1] == 0:
            raise ValueError(f"{_where('Metric', self.name)}: no rank has updated the metric since its "
                             "last reset (total weight 0)")
        mean = total[:-1].reshape(self.shape) / total[-1]
        return float(mean) if self.shape == () else mean
