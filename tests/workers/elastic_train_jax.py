"""An elastic JAX training script (gradsync.jax.elastic) for tests/test_elastic_jax.py.

Linear regression on 48 fixed samples with optax SGD with momentum, wrapped in
``gradsync.jax.DistributedOptimizer``. Each step trains on a global batch of 6 samples (the epoch's
shuffled order, 8 steps an epoch), split evenly over the ranks (2 or 3), so the averaged gradient
does not depend on the number of ranks. The parameters, the optax state and the counters live in a
``JaxState`` committed after every step. Every rank appends one JSON line per step to ``--log``
(launch, rank, size, epoch, step, its sample indices, the state's leaves before the step); rank 0
saves the final parameters to ``--out`` (``numpy.savez``).

  --kill RANK:STEP  on the first launch only, that rank writes ``--kill-slots`` to ``--slots-file``,
                    copies the last commit to ``--commit-copy``, logs the time and SIGKILLs itself
                    at the start of global step STEP.
"""


import elastic_worker
import jax
import jax.numpy as jnp
import numpy as np
import optax

import gradsync
import gradsync.jax

args = elastic_worker.parser().parse_args()

gradsync.init()
GLOBAL_BATCH, STEPS_PER_EPOCH = 6, 8
rng = np.random.default_rng(1)
inputs = rng.standard_normal((48, 4)).astype(np.float32)
targets = (inputs @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32)
           + 0.1 * rng.standard_normal((48, 1)).astype(np.float32))
params = {"w": jax.random.normal(jax.random.PRNGKey(0), (4, 1)), "b": jnp.zeros((1,))}
tx = gradsync.jax.DistributedOptimizer(optax.sgd(0.05, momentum=0.9))
resets = []


def loss(params, x, y):
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


grad_fn = jax.jit(jax.grad(loss))


def my_indices(epoch, step):
    order = np.random.default_rng(epoch).permutation(48)
    batch = order[step * GLOBAL_BATCH:(step + 1) * GLOBAL_BATCH]
    share = GLOBAL_BATCH // gradsync.size()
    return batch[gradsync.rank() * share:(gradsync.rank() + 1) * share]




state = gradsync.jax.elastic.JaxState(params=params, opt_state=tx.init(params), epoch=0, batch=0, step=0)
state.register_reset_callbacks([lambda: resets.append(gradsync.size())])


@gradsync.jax.elastic.run
def train(state):
    while state.epoch < args.epochs:
        while state.batch < STEPS_PER_EPOCH:
            elastic_worker.kill_if_due(args, state.step)
            leaves = [np.asarray(leaf).tolist() for leaf in jax.tree_util.tree_leaves((state.params, state.opt_state))]
            indices = my_indices(state.epoch, state.batch)
            grads = grad_fn(state.params, inputs[indices], targets[indices])
            updates, state.opt_state = tx.update(grads, state.opt_state, state.params)
            state.params = optax.apply_updates(state.params, updates)
            elastic_worker.log(args.log, event="step", epoch=state.epoch, step=state.step, indices=indices.tolist(), leaves=leaves,
                resets=resets)
            state.batch += 1
            state.step += 1
            state.commit()
        state.epoch += 1
        state.batch = 0
        state.commit()


train(state)
if gradsync.rank() == 0 and args.out:
    np.savez(args.out, **{name: np.asarray(value) for name, value in state.params.items()})
