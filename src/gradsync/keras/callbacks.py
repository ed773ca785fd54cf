"""Horovod's Keras callbacks (``horovod.tensorflow.keras.callbacks``) on Keras 3, any backend."""

from __future__ import annotations

from collections.abc import Callable
from numbers import Real

import keras
import numpy as np

from .. import metrics, ops
from ..engine.protocol import ReduceOp
from ..process import runtime
from .optimizer import broadcast_variables

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateScheduleCallback",
           "LearningRateWarmupCallback"]


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """At the start of training, give every rank ``root_rank``'s model and optimizer variables.

    In ``on_train_begin``, where every rank has built its model and its optimizer: training then
    starts from identical weights and optimizer state everywhere, as one process would. Keras 3
    builds some of them in the first train step (a model given no input shape; the optimizer, on
    the TensorFlow backend), and a rank that loaded a checkpoint has its optimizer's slots already
    where a fresh rank has not: then, as Horovod always does, model and optimizer are broadcast
    again at the end of the first batch, once they exist everywhere (the model also at the start,
    if it is built on every rank). Which of the two happens is agreed by the ranks in one small
    collective, so every rank broadcasts the same variables at the same point. The variables in
    ``local_variables`` (Keras variables of the model or the optimizer) keep each rank's own
    value; every rank must pass the same number of them from the same places. ``device`` is
    Horovod's and unused: gradsync moves host copies.

    Raises:
        ValueError: the ranks' models or optimizers have different numbers of variables
            (:func:`gradsync.keras.broadcast_variables`).
    """

    def __init__(self, root_rank: int = 0, device: str = "", local_variables: list | None = None) -> None:
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.local_variables = list(local_variables or [])
        self._after_first_batch = False

    def on_train_begin(self, logs: dict | None = None) -> None:
        optimizer = self.model.optimizer
        built = np.array([self.model.built, optimizer is None or optimizer.built], dtype=np.int32)
        model_built, optimizer_built = ops.allreduce(built, name="BroadcastGlobalVariables.built",
                                                     op=ReduceOp.Min).tolist()
        if model_built:
            self._broadcast_model()
        if model_built and optimizer_built:
            self._broadcast_optimizer()
        self._after_first_batch = not (model_built and optimizer_built)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if not self._after_first_batch:
            return
        self._after_first_batch = False
        if hasattr(self.model, "jax_state_sync"):  # the JAX trainer keeps the state outside the
            self.model.jax_state_sync()  # variables: into them, and read back by the next step
        self._broadcast_model()
        self._broadcast_optimizer()

    def _broadcast_model(self) -> None:
        self._broadcast(self.model.variables, "BroadcastGlobalVariables.model")

    def _broadcast_optimizer(self) -> None:
        if self.model.optimizer is not None:
            self._broadcast(self.model.optimizer.variables, "BroadcastGlobalVariables.optimizer")

    def _broadcast(self, variables: list, name: str) -> None:
        """``variables`` but the local ones, from ``root_rank``."""
        local = {id(v) for v in self.local_variables}
        broadcast_variables([v for v in variables if id(v) not in local], self.root_rank, name=name)


class MetricAverageCallback(keras.callbacks.Callback):
    """At the end of every epoch, replace each numeric entry of ``logs`` (loss, metrics, ``val_``
    ones) by its mean over every rank: one collective (:func:`gradsync.metrics.average_scalars`).

    Put it before the callbacks that read the logs (checkpoints, early stopping, the progress bar
    prints what it got). Every rank must log the same keys (ValueError otherwise).
    """

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if not logs:
            return
        numeric = {k: float(v) for k, v in logs.items() if isinstance(v, Real) or hasattr(v, "__float__")}
        logs.update(metrics.average_scalars(numeric, name=f"MetricAverageCallback.{epoch}"))


def _set_learning_rate(model: keras.Model, value: float) -> None:
    if hasattr(model, "jax_state_sync"):  # the JAX trainer keeps the state outside the variables
        model.jax_state_sync()
    model.optimizer.learning_rate = value


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Set the learning rate to ``initial_lr * multiplier(epoch)`` from ``start_epoch`` up to (not
    including) ``end_epoch`` (``horovod.tensorflow.keras.callbacks.LearningRateScheduleCallback``).

    ``multiplier`` is a number or a function of the epoch; with ``staircase`` (default) it is called
    once per epoch with the integer epoch, otherwise before every batch with the fractional epoch
    ``epoch + batch / steps_per_epoch`` (``steps_per_epoch`` defaults to the steps ``fit`` runs).
    ``momentum_correction`` scales an SGD momentum by new_lr/old_lr for the batch, as Horovod does;
    it takes effect on the torch backend only: under ``jax.jit`` and ``tf.function`` the momentum
    (a python float in Keras 3) is a constant of the compiled step.

    Raises:
        ValueError (at the start of training): no ``steps_per_epoch`` known with ``staircase=False``.
    """

    def __init__(self, initial_lr: float, multiplier: float | Callable[[float], float], start_epoch: int = 0,
                 end_epoch: int | None = None, staircase: bool = True, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None) -> None:
        super().__init__()
        self.initial_lr = initial_lr
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch: multiplier)
        self.start_epoch, self.end_epoch = start_epoch, end_epoch
        self.staircase, self.momentum_correction = staircase, momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = 0
        self._restore_momentum: float | None = None

    def on_train_begin(self, logs: dict | None = None) -> None:
        if self.initial_lr is None:
            self.initial_lr = float(self.model.optimizer.learning_rate)
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = (self.params or {}).get("steps")
            if not self.steps_per_epoch:
                raise ValueError(f"gradsync: rank {runtime.get().rank}: {type(self).__name__}: pass "
                                 "steps_per_epoch; fit did not say how many steps an epoch has")

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self.current_epoch < self.start_epoch or (self.end_epoch is not None
                                                     and self.current_epoch >= self.end_epoch):
            return
        if self.staircase and batch == 0:
            self._adjust(self.current_epoch)
        elif not self.staircase:
            self._adjust(self.current_epoch + batch / self.steps_per_epoch)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self._restore_momentum is not None:
            self.model.optimizer.momentum = self._restore_momentum
            self._restore_momentum = None

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if logs is not None:
            logs["lr"] = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))

    def _adjust(self, epoch: float) -> None:
        optimizer = self.model.optimizer
        old = float(keras.ops.convert_to_numpy(optimizer.learning_rate))
        new = self.initial_lr * self.multiplier(epoch)
        _set_learning_rate(self.model, new)
        momentum = getattr(optimizer, "momentum", None)
        if self.momentum_correction and isinstance(momentum, float) and momentum and old:
            self._restore_momentum = momentum
            optimizer.momentum = momentum * new / old


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramp the learning rate from ``initial_lr / size()`` to ``initial_lr`` over ``warmup_epochs``
    (Goyal et al. 2017, "Accurate, Large Minibatch SGD"), adjusted before every batch
    (``horovod.tensorflow.keras.callbacks.LearningRateWarmupCallback``).

    At fractional epoch e (``epoch + batch / steps_per_epoch``) the rate is
    ``initial_lr / size * ((e + 1/steps_per_epoch) * (size - 1) / warmup_epochs + 1)``, Horovod's
    formula: it reaches ``initial_lr`` on the last batch of the warm-up.
    """

    def __init__(self, initial_lr: float, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None, verbose: int = 0) -> None:
        def multiplier(epoch: float) -> float:
            size = runtime.get().size
            epoch += 1.0 / self.steps_per_epoch
            return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and runtime.get().rank == 0:  # as Horovod
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {logs['lr']:g}.")
