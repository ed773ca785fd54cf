"""Data-parallel training of a small MLP on scikit-learn's digits data set with JAX, optax and gradsync.

The JAX twin of examples/train_digits.py: the same data, model, batch size and optimizer. Every
rank trains the same model on its own shard of the training set; gradsync.jax.DistributedOptimizer
averages the gradients across ranks inside the jitted training step, so N ranks take the same steps
as one process with an N-times larger batch. Lines marked ``# gradsync:`` are the ones that make the
script data-parallel.

    mpiexec -n 2 python examples/train_digits_jax.py          # 2 ranks
    python examples/train_digits_jax.py                       # a single process works too

The last line printed (by rank 0) is ``test_accuracy=<float>``.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from digits import epoch_batches, load_split, training_arguments

import gradsync
import gradsync.jax
from gradsync.metrics import Metric

HIDDEN, CLASSES = 128, 10


def parse_args() -> argparse.Namespace:
    parser = training_arguments(__doc__.splitlines()[0])
    parser.add_argument("--update", choices=["jit", "host"], default="jit",
                        help="jit: the optimizer's update (and so the gradient allreduce) inside the "
                             "jitted step; host: gradients in jit, the update outside it")
    return parser.parse_args()



def init_params(key: jax.Array, features: int = 64) -> dict:
    """Linear(64, 128) + ReLU + Linear(128, 10), initialised as torch.nn.Linear does."""
    def linear(key, fan_in, fan_out):
        bound = 1.0 / np.sqrt(fan_in)
        k_w, k_b = jax.random.split(key)
        return {"w": jax.random.uniform(k_w, (fan_in, fan_out), jnp.float32, -bound, bound),
                "b": jax.random.uniform(k_b, (fan_out,), jnp.float32, -bound, bound)}

    k1, k2 = jax.random.split(key)
    return {"hidden": linear(k1, features, HIDDEN), "out": linear(k2, HIDDEN, CLASSES)}


def logits_fn(params: dict, x: jax.Array) -> jax.Array:
    h = jax.nn.relu(x @ params["hidden"]["w"] + params["hidden"]["b"])
    return h @ params["out"]["w"] + params["out"]["b"]


def loss_fn(params: dict, x: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Mean cross-entropy over the batch, and the logits."""
    logits = logits_fn(params, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), logits


def make_train_step(tx: optax.GradientTransformation, update: str = "jit"):
    """``step(params, state, x, y) -> (params, state, loss, accuracy)``: one SGD step.

    ``update="jit"`` compiles the whole step, the optimizer's update included; ``"host"`` compiles
    the gradient computation and the parameter update, and calls ``tx.update`` between them,
    outside jit.
    """
    def gradients(params, x, y):
        (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, x, y)
        return grads, loss, (logits.argmax(-1) == y).mean()

    def whole_step(params, state, x, y):
        grads, loss, accuracy = gradients(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss, accuracy

    if update == "jit":
        return jax.jit(whole_step)
    gradients_jit, apply_jit = jax.jit(gradients), jax.jit(optax.apply_updates)

    def host_step(params, state, x, y):
        grads, loss, accuracy = gradients_jit(params, x, y)
        updates, state = tx.update(grads, state, params)
        return apply_jit(params, updates), state, loss, accuracy

    return host_step


def evaluate(params: dict, x: np.ndarray, y: np.ndarray) -> float:
    """Accuracy on the whole test set: each rank scores its shard, then the counts are combined."""
    x, y = x[gradsync.rank()::gradsync.size()], y[gradsync.rank()::gradsync.size()]
    accuracy = float((np.asarray(jax.jit(logits_fn)(params, x)).argmax(-1) == y).mean())
    # gradsync: the accuracy over all ranks' shards, each weighted by its number of samples.
    test_accuracy = Metric("test_accuracy")
    test_accuracy.update(accuracy, weight=len(y))
    return test_accuracy.compute()


def main() -> None:
    args = parse_args()
    gradsync.init()  # gradsync: start the background coordinator
    rank, size = gradsync.rank(), gradsync.size()
    x_train, y_train, x_test, y_test = load_split(np.int32)  # the same split on every rank (digits.py)

    params = init_params(jax.random.key(args.seed))
    # gradsync: every rank starts from rank 0's weights (here they agree already: same seed).
    params = gradsync.jax.broadcast_parameters(params, root_rank=0)
    # gradsync: the batch is `size` times larger than one process's, so is the learning rate;
    # the wrapped optimizer averages the gradients across ranks before each update.
    tx = gradsync.jax.DistributedOptimizer(optax.sgd(args.lr * size, momentum=0.9))
    state = tx.init(params)
    step = make_train_step(tx, args.update)

    # gradsync: per-sample means over every rank's batches, averaged across ranks when read.
    train_loss, train_acc = Metric("train_loss"), Metric("train_accuracy")
    for epoch in range(args.epochs):
        train_loss.reset()
        train_acc.reset()
        # Disjoint shards of one permutation, the same number of full batches on every rank (the
        # remainder dropped), so no rank waits at an allreduce another never reaches (digits.py).
        for batch in epoch_batches(len(y_train), epoch, args.seed, rank, size, args.batch_size):
            params, state, loss, accuracy = step(params, state, x_train[batch], y_train[batch])
            train_loss.update(loss, weight=len(batch))
            train_acc.update(accuracy, weight=len(batch))
        # gradsync: read the metrics (a collective: every rank computes them, rank 0 prints).
        loss_now, acc_now = train_loss.compute(), train_acc.compute()
        test_acc = evaluate(params, x_test, y_test)
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs}: train_loss={loss_now:.4f} "
                  f"train_accuracy={acc_now:.4f} test_accuracy={test_acc:.4f}", flush=True)

    final = evaluate(params, x_test, y_test)
    if rank == 0:
        print(f"test_accuracy={final:.4f}", flush=True)


if __name__ == "__main__":
    main()
