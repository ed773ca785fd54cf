"""What crossing into Python costs a TensorFlow train step: Keras's step with its gradients handed
through a ``tf.numpy_function``, one process, no gradsync, no MPI.

    python benchmarks/tf_boundary.py [--batch 128] [--blocks 8] [--steps 10]

gradsync's TensorFlow ops (gradsync.tensorflow, gradsync.keras on TensorFlow) are stateful
``tf.numpy_function`` ops (src/gradsync/tensorflow/host_op.py): without a compiled kernel, which
gradsync does not ship, that is how a TensorFlow graph calls a collective. This script measures
that boundary alone, on the model of benchmarks/keras_step.py (MLP 784-1024-1024-10, 7.4 MB of
float32 gradients in 6 tensors, SGD with momentum), each configuration a model of its own,
trained in turn in blocks of ``--steps`` steps in one process (one compute thread):

* ``plain``: Keras's step as it is.
* ``token``: a numpy_function takes the gradients and returns a scalar; the update waits for it and
  uses TensorFlow's own gradients (the crossing in, no results handed back).
* ``identity``: the numpy_function returns its inputs (the crossing in and out).
* ``fresh``: it returns arrays of its own, 64-byte aligned, filled once (what an out-of-place
  collective hands back, without the writing of the results).
* ``copy``: it returns a fresh 64-byte aligned copy of each gradient (the writing too: one pass
  over 7.4 MB, as the unpack of a fusion buffer is).

Prints each configuration's median step (ms) and its median ratio to ``plain`` over the blocks.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

SIZES = (784, 1024, 1024, 10)
MODES = ("plain", "token", "identity", "fresh", "copy")


def aligned_copy(array: np.ndarray) -> np.ndarray:
    """A copy of ``array`` whose data starts on a 64-byte boundary (TensorFlow takes such an
    array as a tensor without copying it)."""
    raw = np.empty(array.nbytes + 64, np.uint8)
    start = (-raw.ctypes.data) % 64
    out = raw[start:start + array.nbytes].view(array.dtype).reshape(array.shape)
    out[...] = array
    return out


def host_function(mode: str):
    """The numpy function of ``mode`` (not ``plain`` or ``token``)."""
    if mode == "identity":
        return lambda *arrays: list(arrays)
    if mode == "copy":
        return lambda *arrays: [aligned_copy(a) for a in arrays]
    kept: list[np.ndarray] = []

    def fresh(*arrays: np.ndarray) -> list[np.ndarray]:
        if not kept:
            kept.extend(aligned_copy(np.zeros_like(a)) for a in arrays)
        return kept
    return fresh


def optimizer(mode: str) -> keras.optimizers.Optimizer:
    """SGD with momentum whose ``apply`` hands the gradients through the boundary of ``mode``."""

    class Crossing(keras.optimizers.SGD):
        def apply(self, grads, trainable_variables=None):
            grads = list(grads)
            if mode == "token":
                token = tf.numpy_function(lambda *a: np.int64(0), grads, tf.int64, stateful=True)
                with tf.control_dependencies([token]):
                    grads = [tf.identity(g) for g in grads]
            elif mode != "plain":
                outputs = tf.numpy_function(host_function(mode), grads, [g.dtype for g in grads],
                                            stateful=True)
                for output, grad in zip(outputs, grads):
                    output.set_shape(grad.shape)
                grads = list(outputs)
            return super().apply(grads, trainable_variables)

    return Crossing(0.01, momentum=0.9)


def model_for(mode: str) -> keras.Model:
    keras.utils.set_random_seed(0)
    layers = [keras.layers.Dense(n, activation="relu") for n in SIZES[1:-1]]
    model = keras.Sequential([keras.Input((SIZES[0],)), *layers, keras.layers.Dense(SIZES[-1])])
    model.compile(optimizer=optimizer(mode), loss="mse")
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--blocks", type=int, default=8, help="rounds over the configurations")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per block")
    args = parser.parse_args()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    rng = np.random.default_rng(0)
    x = rng.random((args.batch, SIZES[0]), dtype=np.float32)
    y = rng.random((args.batch, SIZES[-1]), dtype=np.float32)
    models = {mode: model_for(mode) for mode in MODES}
    for model in models.values():  # trace and warm up
        for _ in range(5):
            model.train_on_batch(x, y)
    blocks: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(args.blocks):
        for mode, model in models.items():
            times = []
            for _ in range(args.steps):
                start = time.perf_counter()
                model.train_on_batch(x, y)
                times.append(time.perf_counter() - start)
            blocks[mode].append(statistics.median(times) * 1e3)
    print(f"Keras MLP {'-'.join(map(str, SIZES))} on TensorFlow {tf.__version__}, batch {args.batch}, "
          f"one thread, {args.blocks} blocks of {args.steps} steps; load average {os.getloadavg()[0]:.1f}")
    print(f"{'configuration':10s} {'step ms':>8s} {'vs plain':>9s} {'+ms':>6s}")
    for mode in MODES:
        ratio = statistics.median(a / b for a, b in zip(blocks[mode], blocks["plain"]))
        extra = statistics.median(a - b for a, b in zip(blocks[mode], blocks["plain"]))
        print(f"{mode:10s} {statistics.median(blocks[mode]):8.2f} {ratio:9.3f} {extra:6.2f}")


if __name__ == "__main__":
    main()
