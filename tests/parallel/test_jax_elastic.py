"""gradsync.jax.elastic.JaxState at fixed ranks: sync, restore, and a commit written under the
driver's state directory that ``run`` resumes from. References are exact values: rank 0's pytree
after a sync, the saved pytree after a restore, the committed pytree after a resume."""


import numpy as np
import pytest

import gradsync

pytestmark = pytest.mark.jax
jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
gj = pytest.importorskip("gradsync.jax")
jnp = jax.numpy


def state_of(seed):
    """A JaxState whose parameters, optax momentum and counters differ by ``seed``."""
    params = {"w": jnp.arange(6.0).reshape(2, 3) + seed, "b": np.full(3, seed, np.float32)}
    tx = optax.sgd(0.1, momentum=0.9)
    opt_state = tx.init(params)
    _, opt_state = tx.update(jax.tree_util.tree_map(jnp.ones_like, params), opt_state, params)
    return gj.elastic.JaxState(params=params, opt_state=opt_state, epoch=seed, history=[seed])


def leaves(state):
    return [np.array(leaf) for leaf in jax.tree_util.tree_leaves((state.params, state.opt_state))]  # copies


def assert_same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and np.array_equal(g, w), (g, w)


def test_sync_gives_every_rank_rank_0s_pytrees_and_attributes():
    state = state_of(gradsync.rank())
    state.sync()
    assert_same(leaves(state), leaves(state_of(0)))
    assert (state.epoch, state.history) == (0, [0])
    assert isinstance(state.params["b"], jax.Array)  # a numpy leaf comes back as a jax array


def test_restore_goes_back_to_the_last_save_numpy_leaves_included():
    state = state_of(1)
    saved = leaves(state)
    state.params["b"][:] = 7.0  # a numpy leaf changed in place
    state.params = {**state.params, "w": state.params["w"] * 2}
    state.history.append(2)
    state.epoch = 5
    state.restore()
    assert_same(leaves(state), saved)
    assert (state.epoch, state.history) == (1, [1])


def test_run_resumes_from_the_commit_exactly(state_dir):
    committed = state_of(3)
    committed.commit()
    gradsync.barrier()
    resets = []
    restarted = state_of(gradsync.rank() + 10)
    restarted.register_reset_callbacks([lambda: resets.append(restarted.epoch)])

    @gj.elastic.run
    def train(state):
        return leaves(state), state.epoch, state.history

    got, epoch, history = train(restarted)
    assert_same(got, leaves(state_of(3)))
    assert (epoch, history, resets) == (3, [3], [3])
    assert jax.tree_util.tree_structure(restarted.opt_state) == jax.tree_util.tree_structure(committed.opt_state)
