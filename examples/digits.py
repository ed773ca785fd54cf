"""The data every example trains on: scikit-learn's bundled digits (1797 images of 8x8 pixels, no
download), split into the same 1347 training and 450 test images on every rank. The examples import
it from beside themselves (``python examples/train_digits*.py`` puts this folder on ``sys.path``)."""

from __future__ import annotations

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
