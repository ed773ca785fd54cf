"""Data-parallel training of a small MLP on scikit-learn's digits data set with TensorFlow and gradsync.

The TensorFlow twin of examples/train_digits.py: the same data, model, batch size and optimizer
(SGD with momentum 0.9). A custom training loop, as Horovod's TensorFlow 2 examples write it: the
step is a ``tf.function`` whose ``tf.GradientTape`` is wrapped in
``gradsync.tensorflow.DistributedGradientTape``, which averages the gradients across ranks inside
the graph, so N ranks take the same steps as one process with an N-times larger batch. Lines
marked ``# gradsync:`` are the ones that make the script data-parallel.

    mpiexec -n 2 python examples/train_digits_tf.py          # 2 ranks
    python examples/train_digits_tf.py                       # a single process works too

The last line printed (by rank 0) is ``test_accuracy=<float>``.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow is imported

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from digits import epoch_batches, load_split, training_arguments  # noqa: E402

import gradsync.tensorflow as hvd  # noqa: E402  gradsync: horovod.tensorflow's API
from gradsync.metrics import Metric  # noqa: E402

HIDDEN, CLASSES = 128, 10


def parse_args() -> argparse.Namespace:
    parser = training_arguments(__doc__.splitlines()[0])
    return parser.parse_args()



def init_variables(seed: int, features: int = 64) -> list[tf.Variable]:
    """Linear(64, 128) + ReLU + Linear(128, 10), initialised as torch.nn.Linear does."""
    rng = np.random.default_rng(seed)

    def uniform(fan_in, shape):
        bound = 1.0 / np.sqrt(fan_in)
        return tf.Variable(rng.uniform(-bound, bound, shape).astype(np.float32))

    return [uniform(features, (features, HIDDEN)), uniform(features, (HIDDEN,)),
            uniform(HIDDEN, (HIDDEN, CLASSES)), uniform(HIDDEN, (CLASSES,))]


def logits_fn(variables: list[tf.Variable], x: tf.Tensor) -> tf.Tensor:
    w1, b1, w2, b2 = variables
    return tf.nn.relu(x @ w1 + b1) @ w2 + b2


def make_train_step(variables: list[tf.Variable], lr: float, momentum: float = 0.9):
    """``step(x, y) -> (loss, accuracy)``: one step of SGD with momentum, as a tf.function."""
    velocities = [tf.Variable(tf.zeros_like(v)) for v in variables]

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            logits = logits_fn(variables, x)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
        # gradsync: the tape's gradient() returns every rank's gradients averaged.
        tape = hvd.DistributedGradientTape(tape)
        for v, velocity, g in zip(variables, velocities, tape.gradient(loss, variables)):
            velocity.assign(momentum * velocity + g)
            v.assign_sub(lr * velocity)
        accuracy = tf.reduce_mean(tf.cast(tf.argmax(logits, -1, tf.int32) == y, tf.float32))
        return loss, accuracy

    return step


def evaluate(variables: list[tf.Variable], x: np.ndarray, y: np.ndarray) -> float:
    """Accuracy on the whole test set: each rank scores its shard, then the counts are combined."""
    x, y = x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]
    accuracy = float((logits_fn(variables, tf.constant(x)).numpy().argmax(-1) == y).mean())
    # gradsync: the accuracy over all ranks' shards, each weighted by its number of samples.
    test_accuracy = Metric("test_accuracy")
    test_accuracy.update(accuracy, weight=len(y))
    return test_accuracy.compute()


def main() -> None:
    args = parse_args()
    hvd.init()  # gradsync: start the background coordinator
    rank, size = hvd.rank(), hvd.size()
    tf.config.threading.set_intra_op_parallelism_threads(1)  # one process per core
    x_train, y_train, x_test, y_test = load_split(np.int32)  # the same split on every rank (digits.py)

    variables = init_variables(args.seed + rank)  # each rank draws its own weights...
    # gradsync: ...and every rank starts from rank 0's.
    hvd.broadcast_variables(variables, root_rank=0)
    # gradsync: the batch is `size` times larger than one process's, so is the learning rate.
    step = make_train_step(variables, args.lr * size)

    # gradsync: per-sample means over every rank's batches, averaged across ranks when read.
    train_loss, train_acc = Metric("train_loss"), Metric("train_accuracy")
    for epoch in range(args.epochs):
        train_loss.reset()
        train_acc.reset()
        # Disjoint shards of one permutation, the same number of full batches on every rank (the
        # remainder dropped), so no rank waits at an allreduce another never reaches (digits.py).
        for batch in epoch_batches(len(y_train), epoch, args.seed, rank, size, args.batch_size):
            loss, accuracy = step(tf.constant(x_train[batch]), tf.constant(y_train[batch]))
            train_loss.update(float(loss), weight=len(batch))
            train_acc.update(float(accuracy), weight=len(batch))
        # gradsync: read the metrics (a collective: every rank computes them, rank 0 prints).
        loss_now, acc_now = train_loss.compute(), train_acc.compute()
        test_acc = evaluate(variables, x_test, y_test)
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs}: train_loss={loss_now:.4f} "
                  f"train_accuracy={acc_now:.4f} test_accuracy={test_acc:.4f}", flush=True)

    final = evaluate(variables, x_test, y_test)
    if rank == 0:
        print(f"test_accuracy={final:.4f}", flush=True)


if __name__ == "__main__":
    main()
