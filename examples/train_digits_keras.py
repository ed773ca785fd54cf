"""Data-parallel training of a small MLP on scikit-learn's digits data set with Keras 3 and gradsync.

The Keras twin of examples/train_digits.py (same data, model, batch size and optimizer), on any
Keras backend gradsync supports: choose it with KERAS_BACKEND before the run. Every rank fits the
same model on its own shard of the training set; gradsync.keras.DistributedOptimizer averages the
gradients inside model.fit's compiled train step. Lines marked ``# gradsync:`` are the ones that
make the script data-parallel (the same lines as with horovod.tensorflow.keras).

    KERAS_BACKEND=jax mpiexec -n 2 python examples/train_digits_keras.py
    KERAS_BACKEND=torch mpiexec -n 2 python examples/train_digits_keras.py
    KERAS_BACKEND=tensorflow mpiexec -n 2 python examples/train_digits_keras.py

The last line printed (by rank 0) is ``test_accuracy=<float>``.
"""

from __future__ import annotations

import argparse
import os

import numpy as np
from digits import load_split, training_arguments

os.environ.setdefault("KERAS_BACKEND", "jax")
import keras  # noqa: E402  (after KERAS_BACKEND)

import gradsync.keras as hvd  # noqa: E402

HIDDEN, CLASSES = 128, 10


def parse_args() -> argparse.Namespace:
    parser = training_arguments(__doc__.splitlines()[0])
    return parser.parse_args()



def main() -> None:
    args = parse_args()
    hvd.init()  # gradsync: start MPI and the coordinator
    if keras.backend.backend() == "torch":
        import torch

        torch.set_num_threads(1)  # one core per rank
    keras.utils.set_random_seed(args.seed)
    x_train, y_train, x_test, y_test = load_split(np.int32)  # the same split on every rank (digits.py)
    # gradsync: each rank its shard, the same number of steps on every rank
    steps = len(x_train) // (args.batch_size * hvd.size())
    shard = np.arange(hvd.rank(), steps * args.batch_size * hvd.size(), hvd.size())
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(HIDDEN, activation="relu"),
                              keras.layers.Dense(CLASSES)])
    optimizer = keras.optimizers.SGD(args.lr * hvd.size(), momentum=0.9)  # gradsync: lr times ranks
    model.compile(optimizer=hvd.DistributedOptimizer(optimizer),  # gradsync: average the gradients
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),  # gradsync: rank 0's weights
                 hvd.callbacks.MetricAverageCallback()]  # gradsync: logs averaged over ranks
    model.fit(x_train[shard], y_train[shard], batch_size=args.batch_size, epochs=args.epochs,
              callbacks=callbacks, verbose=2 if hvd.rank() == 0 else 0)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    if hvd.rank() == 0:
        print(f"test_accuracy={accuracy:.4f}")


if __name__ == "__main__":
    main()
