"""Elastic state for JAX: ``gradsync.jax.elastic.JaxState`` and ``run``, resized by restarts.

Horovod had no elastic state for JAX; this one follows ``gradsync.torch.elastic.TorchState``'s API
(``commit()``, ``restore()``, ``sync()``, ``check_host_updates()``, reset callbacks, any further
attributes) over pytrees: the parameters and an optax state, or anything else whose leaves are
arrays. Under the elastic driver (``python -m gradsync.run``, docs/elastic.md) rank 0 writes each
commit to the driver's state directory and a restarted job resumes from it through ``run``; what a
commit, a resume and a host update do is :mod:`gradsync.elastic`'s, shared with PyTorch::

    state = gradsync.jax.elastic.JaxState(params=params, opt_state=tx.init(params), epoch=0, step=0)

    @gradsync.jax.elastic.run
    def train(state):
        while state.step < steps:
            grads = grad_fn(state.params, *batch(state.step))
            updates, state.opt_state = tx.update(grads, state.opt_state, state.params)
            state.params = optax.apply_updates(state.params, updates)
            state.step += 1
            state.commit()
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..elastic import AttributesState, HostsUpdatedInterrupt, entry, run
from .collectives import broadcast

__all__ = ["run", "JaxState", "HostsUpdatedInterrupt"]


def is_pytree_of_arrays(value: Any) -> bool:
    """True when ``value`` is a pytree with at least one leaf and every leaf a jax or numpy array."""
    leaves = jax.tree_util.tree_leaves(value)
    return bool(leaves) and all(isinstance(leaf, (jax.Array, np.ndarray)) for leaf in leaves)


def _snapshot(tree: Any) -> Any:
    """A copy of ``tree`` that later changes cannot reach: jax arrays are immutable and kept as they
    are; numpy leaves are copied."""
    return jax.tree_util.tree_map(lambda leaf: np.array(leaf) if isinstance(leaf, np.ndarray) else leaf,
                                  tree)


class JaxState(AttributesState):
    """The state of a JAX training process: pytrees of arrays and plain attributes.

    Every keyword argument becomes an attribute. A value that is a pytree of jax or numpy arrays
    (``params``, an optax state, batch statistics) is saved by reference (jax arrays are immutable;
    numpy leaves are copied), synced leaf by leaf with :func:`gradsync.jax.broadcast` (so every rank
    must hold the same structure, shapes and dtypes), and committed with its leaves as numpy arrays
    (``jax.device_get``, exact); a restart gives it back as jax arrays of the same dtypes and
    structure. Any other value (epoch, step, lists) is saved as a deep copy and synced with
    ``broadcast_object``, so it must pickle; ``sync`` gives every rank rank 0's *committed* plain
    attributes, as ``TorchState``. Which attributes are pytrees is decided here, once.

    Args:
        params: a pytree of arrays (the model's parameters), or None.
        opt_state: a pytree of arrays (an optax state), or None.
        kwargs: further attributes.
    """

    def __init__(self, params: Any = None, opt_state: Any = None, **kwargs: Any):
        super().__init__()
        kwargs.update(params=params, opt_state=opt_state)
        self._trees = [name for name, value in kwargs.items() if is_pytree_of_arrays(value)]
        for name in self._trees:
            setattr(self, name, kwargs.pop(name))
        self._set_attributes(kwargs)
        self.save()

    def save(self) -> None:
        """Keep the pytrees (numpy leaves copied) and deep copies of the plain attributes."""
        self._saved_trees = {name: _snapshot(getattr(self, name)) for name in self._trees}
        self._save_attributes()

    def restore(self) -> None:
        """Go back to the last saved state (uncommitted changes are lost)."""
        for name, tree in self._saved_trees.items():
            setattr(self, name, _snapshot(tree))
        self._restore_attributes()

    def committed(self) -> dict[str, dict[str, Any]]:
        """The last saved state: ``{"trees": name -> pytree of numpy arrays, "attrs": name -> value}``."""
        return {"trees": {name: jax.device_get(tree) for name, tree in self._saved_trees.items()},
                "attrs": dict(self._saved)}

    def load_committed(self, committed: dict[str, dict[str, Any]]) -> None:
        """Take ``committed()``'s output: the pytrees as jax arrays, the plain attributes as they are.

        Raises:
            KeyError: the commit lacks one of this state's attributes (the script changed).
        """
        for name in self._trees:
            setattr(self, name, jax.tree_util.tree_map(jnp.asarray, entry(committed["trees"], name)))
        self._load_attributes(committed["attrs"])
        self.save()

    def sync(self) -> None:
        """Every rank takes rank 0's pytrees and committed attributes: a collective every rank calls."""
        for name in self._trees:
            setattr(self, name, broadcast(getattr(self, name), root_rank=0, name=f"elastic.{name}"))
        self._sync_attributes()
