"""``horovod.tensorflow.keras.callbacks``'s path for :mod:`gradsync.keras.callbacks` (the same classes)."""

from __future__ import annotations

from ...keras.callbacks import *  # noqa: F403
from ...keras.callbacks import __all__  # noqa: F401
