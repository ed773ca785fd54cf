"""Elastic state for TensorFlow 2: ``hvd.elastic.TensorFlowState``, ``TensorFlowKerasState``, ``run``.

A drop-in for ``horovod.tensorflow.elastic``. What a commit, a resume and a host update do is
:mod:`gradsync.elastic`'s, shared with PyTorch, JAX and Keras: under the elastic driver
(``python -m gradsync.run``, docs/elastic.md) rank 0 writes each commit to the driver's state
directory and a restarted job resumes from it through ``run``::

    state = hvd.elastic.TensorFlowState(model.variables + optimizer.variables, batch=0, epoch=0)

    @hvd.elastic.run
    def train(state):
        for state.batch in range(state.batch, batches):
            train_step(next(data))
            state.commit()

Eager TensorFlow only (Horovod's is too: its TF1 session state is not provided here).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from ..elastic import AttributesState, HostsUpdatedInterrupt, run
from .grouped import broadcast_variables

__all__ = ["run", "TensorFlowState", "TensorFlowKerasState", "HostsUpdatedInterrupt"]


class TensorFlowState(AttributesState):
    """A list of ``tf.Variable`` and plain attributes (Horovod's ``TensorFlowState``, eager).

    The variables' values are kept as numpy copies at ``save()``, assigned back at ``restore()``,
    synced from rank 0 with :func:`gradsync.tensorflow.broadcast_variables` and committed as numpy
    arrays, exactly. Every further keyword becomes an attribute (deep-copied; it must pickle).

    Args:
        variables: the variables (e.g. ``model.variables + optimizer.variables``); every rank
            passes the same ones, in the same order. Default: none.
        session: Horovod's TF1 session argument; must be None.
        kwargs: further attributes.

    Raises:
        ValueError: a ``session`` was given, or TensorFlow is not executing eagerly.
    """

    def __init__(self, variables: list[tf.Variable] | None = None, session: Any = None,
                 **kwargs: Any) -> None:
        super().__init__()
        if session is not None or not tf.executing_eagerly():
            raise ValueError("gradsync: TensorFlowState supports eager TensorFlow 2 only (no TF1 "
                             "session or graph), as Horovod's does under TensorFlow 2")
        self.variables = list(variables or [])
        self._set_attributes(kwargs)
        self.save()

    def save(self) -> None:
        """Keep numpy copies of the variables and deep copies of the attributes."""
        self._saved_values = [np.array(v.numpy()) for v in self.variables]
        self._save_attributes()

    def restore(self) -> None:
        """Go back to the last saved state (what came after it is lost)."""
        for variable, value in zip(self.variables, self._saved_values):
            variable.assign(value)
        self._restore_attributes()

    def committed(self) -> dict[str, Any]:
        """The last saved state: ``{"variables": [arrays], "attrs": {name: value}}``."""
        return {"variables": self._saved_values, "attrs": dict(self._saved)}

    def load_committed(self, committed: dict[str, Any]) -> None:
        """Take ``committed()``'s output (a restarted job's rank 0), then save it.

        Raises:
            KeyError: the commit lacks one of this state's attributes (the script changed).
            ValueError: the commit holds a different number of variables.
        """
        values = committed["variables"]
        if len(values) != len(self.variables):
            raise ValueError(f"gradsync: TensorFlowState: the commit holds {len(values)} variables, "
                             f"this state has {len(self.variables)}")
        for variable, value in zip(self.variables, values):
            variable.assign(value)
        self._load_attributes(committed["attrs"])
        self.save()

    def sync(self) -> None:
        """Every rank takes rank 0's variables and saved attributes, then saves: a collective."""
        if self.variables:
            broadcast_variables(self.variables, root_rank=0)
        self._sync_attributes()
        self.save()


def TensorFlowKerasState(model: Any, optimizer: Any = None, backend: Any = None,  # noqa: N802
                         **kwargs: Any) -> Any:
    """Horovod's ``TensorFlowKerasState``: :class:`gradsync.keras.elastic.KerasState` of ``model``
    and ``optimizer`` (``backend`` is Horovod's and unused). Imports ``gradsync.keras``, so Keras
    runs on the TensorFlow backend (``KERAS_BACKEND=tensorflow``, Keras 3's default)."""
    from ..keras.elastic import KerasState

    return KerasState(model, optimizer, **kwargs)
