"""The data every example trains on: scikit-learn's bundled digits (1797 images of 8x8 pixels, no
download), split into the same 1347 training and 450 test images on every rank. The examples import
it from beside themselves (``python examples/train_digits*.py`` puts this folder on ``sys.path``)."""

from __future__ import annotations

import argparse

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split


def load_split(label_dtype: type = np.int64) -> tuple[np.ndarray, ...]:
    """``(x_train, y_train, x_test, y_test)``: pixels scaled to [0, 1] as float32 arrays of shape
    (n, 64), labels 0-9 as ``label_dtype`` arrays of shape (n,); a stratified split fixed by
    ``random_state=0``, the same on every rank and every run."""
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(label_dtype)
    train, test = train_test_split(np.arange(len(y)), test_size=0.25, random_state=0,
                                   stratify=digits.target)
    return x[train], y[train], x[test], y[test]


def training_arguments(description: str) -> argparse.ArgumentParser:
    """A parser with the options every framework's example takes: ``--epochs`` (20),
    ``--batch-size`` (32 samples per step on each rank), ``--lr`` (0.05 for one process; the
    examples multiply it by the number of ranks) and ``--seed`` (0); add an example's own to it."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="samples per step on each rank")
    parser.add_argument("--lr", type=float, default=0.05,
                        help="learning rate of one process; multiplied by the number of ranks")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def epoch_batches(samples: int, epoch: int, seed: int, rank: int, size: int,
                  batch_size: int) -> np.ndarray:
    """This rank's batches of one epoch, as indices of shape (steps, batch_size): a permutation of
    the ``samples`` indices that every rank draws alike (``seed + epoch``), dealt out as disjoint
    shards ``order[rank::size]``, with the same number of steps on every rank
    (``samples // size // batch_size``)."""
    steps = samples // size // batch_size
    order = np.random.default_rng(seed + epoch).permutation(samples)
    return order[rank::size][:steps * batch_size].reshape(steps, batch_size)
