"""Elastic state for Keras 3 on any backend: ``hvd.elastic.KerasState``, its callbacks and ``run``.

A drop-in for ``horovod.tensorflow.keras.elastic`` (``KerasState``, ``CommitStateCallback``,
``UpdateBatchStateCallback``, ``UpdateEpochStateCallback``, ``run``). What a commit, a resume and a
host update do is :mod:`gradsync.elastic`'s, shared with PyTorch and JAX: under the elastic driver
(``python -m gradsync.run``, docs/elastic.md) rank 0 writes each commit to the driver's state
directory, and a restarted job resumes from it through ``run``::

    state = hvd.elastic.KerasState(model, batch=0, epoch=0)

    @hvd.elastic.run
    def train(state):
        model.fit(x, y, epochs=epochs - state.epoch, callbacks=[
            hvd.elastic.UpdateBatchStateCallback(state), hvd.elastic.UpdateEpochStateCallback(state),
            hvd.elastic.CommitStateCallback(state)])  # commit last: after the counters moved

The order of the callbacks matters as in Horovod: Keras calls them in list order, so the counters'
callbacks come before ``CommitStateCallback``, whose commit then holds the counters of the batch
and epoch just done.

    train(state)
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from .. import ops
from ..elastic import AttributesState, HostsUpdatedInterrupt, State, run

__all__ = ["run", "KerasState", "HostsUpdatedInterrupt", "CommitStateCallback",
           "UpdateBatchStateCallback", "UpdateEpochStateCallback"]


def _values(variables: list) -> list[np.ndarray]:
    """Host copies of Keras variables' values (``keras.ops.convert_to_numpy``, copied)."""
    return [np.array(keras.ops.convert_to_numpy(v)) for v in variables]


class KerasState(AttributesState):
    """The state of a Keras model, its optimizer and plain attributes (Horovod's ``KerasState``).

    The model's weights (``model.variables``: trainable and not, e.g. batch-norm statistics) and the
    optimizer's variables (``optimizer.variables``: iterations, slots; those of an optimizer not
    built yet are empty) are kept as numpy copies, synced from rank 0 with
    :func:`gradsync.keras.broadcast_variables` and committed as numpy arrays, exactly. Every
    further keyword becomes an attribute (``batch``, ``epoch``, ...), kept as a deep copy and synced
    with ``broadcast_object``, so it must pickle.

    Args:
        model: a Keras model (built: its variables exist).
        optimizer: its optimizer; default ``model.optimizer`` (the one ``compile`` was given).
        kwargs: further attributes.

    Raises:
        ValueError: ``model`` has no variables yet (build it, or call it on a batch, first).
    """

    def __init__(self, model: keras.Model, optimizer: Any = None, **kwargs: Any) -> None:
        super().__init__()
        if not model.variables:
            raise ValueError(f"gradsync: KerasState: the model {model.name!r} has no variables yet: "
                             "build it (model.build(input_shape) or call it on a batch) first")
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        self._set_attributes(kwargs)
        self.save()

    def _optimizer_variables(self) -> list:
        return list(self.optimizer.variables) if self.optimizer is not None else []

    def _attach_fit_state(self) -> None:
        """Inside ``fit`` on the JAX backend the step's state lives outside the variables until
        the epoch ends; ``jax_state_sync`` writes it back (Keras's hook for callbacks), and the next
        step then reads the variables again, so what ``restore`` assigns is what trains on."""
        sync = getattr(self.model, "jax_state_sync", None)
        if sync is not None:
            sync()

    def save(self) -> None:
        """Keep copies of the model's and the optimizer's variables and of the plain attributes."""
        self._attach_fit_state()
        self._saved_model = _values(self.model.variables)
        self._saved_optimizer = _values(self._optimizer_variables())
        self._save_attributes()

    def restore(self) -> None:
        """Go back to the last saved state (what came after it is lost)."""
        self._attach_fit_state()
        self._assign(self._saved_model, self._saved_optimizer)
        self._restore_attributes()

    def _assign(self, model_values: list[np.ndarray], optimizer_values: list[np.ndarray]) -> None:
        for variable, value in zip(self.model.variables, model_values):
            variable.assign(value)
        if self.optimizer is None:
            return
        if len(optimizer_values) > len(self._optimizer_variables()) and not self.optimizer.built:
            self.optimizer.build(self.model.trainable_variables)  # a restart: make its slots first
        variables = self._optimizer_variables()
        if len(variables) != len(optimizer_values):
            raise ValueError(f"gradsync: KerasState: the saved state holds {len(optimizer_values)} "
                             f"optimizer variables, the optimizer {self.optimizer.name!r} has "
                             f"{len(variables)} (a different optimizer, or one built differently)")
        for variable, value in zip(variables, optimizer_values):
            variable.assign(value)

    def committed(self) -> dict[str, Any]:
        """The last saved state: ``{"model": [arrays], "optimizer": [arrays], "attrs": {name: value}}``."""
        return {"model": self._saved_model, "optimizer": self._saved_optimizer,
                "attrs": dict(self._saved)}

    def load_committed(self, committed: dict[str, Any]) -> None:
        """Take ``committed()``'s output (a restarted job's rank 0), then save it.

        Raises:
            KeyError: the commit lacks one of this state's attributes (the script changed).
            ValueError: the commit holds a different number of model variables (the model changed).
        """
        model = committed["model"]
        if len(model) != len(self.model.variables):
            raise ValueError(f"gradsync: KerasState: the commit holds {len(model)} model variables, "
                             f"the model {self.model.name!r} has {len(self.model.variables)}")
        self._assign(model, committed["optimizer"])
        self._load_attributes(committed["attrs"])
        self.save()

    def sync(self) -> None:
        """Every rank takes rank 0's variables and committed attributes, then saves them: a
        collective every rank calls (with the same model, and its optimizer built alike)."""
        from .optimizer import broadcast_variables

        self._attach_fit_state()
        broadcast_variables(self.model.variables, root_rank=0, name="elastic.model")
        if self.optimizer is not None:
            # Rank 0 may have built its optimizer (loading a commit) where the others have not: the
            # same variables everywhere before they are broadcast, or the ranks' collectives differ.
            if (ops.broadcast_object(self.optimizer.built, root_rank=0, name="elastic.optimizer_built")
                    and not self.optimizer.built):
                self.optimizer.build(self.model.trainable_variables)
            broadcast_variables(self._optimizer_variables(), root_rank=0, name="elastic.optimizer")
        self._sync_attributes()
        self.save()


class CommitStateCallback(keras.callbacks.Callback):
    """Commit ``state`` every ``batches_per_commit`` batches and at the end of every epoch
    (Horovod's ``CommitStateCallback``); a commit may raise ``HostsUpdatedInterrupt``, which
    ``run`` handles."""

    def __init__(self, state: State, batches_per_commit: int = 1) -> None:
        super().__init__()
        if batches_per_commit < 1:
            raise ValueError(f"gradsync: CommitStateCallback: batches_per_commit must be at least 1, "
                             f"not {batches_per_commit!r}")
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.batches_remaining = self.batches_per_commit

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keep ``state.batch`` at the number of the last batch done in this epoch, 0 after an epoch
    (Horovod's ``UpdateBatchStateCallback``). Horovod also shortens the first epoch after a reset
    by ``state.batch`` steps through ``params['steps']``, which Keras 3's fit loop does not read:
    skip the batches done yourself (e.g. slice the data from ``state.batch``)."""

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.state.batch = batch

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Set ``state.epoch`` to the number of epochs done after each epoch, counting from the value
    it had when training began (Horovod's ``UpdateEpochStateCallback``)."""

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state
        self.initial_epoch = state.epoch

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.epoch = self.initial_epoch + epoch + 1
