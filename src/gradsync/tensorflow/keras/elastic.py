"""``horovod.tensorflow.keras.elastic``'s path for :mod:`gradsync.keras.elastic` (the same classes)."""

from __future__ import annotations

from ...keras.elastic import *  # noqa: F403
from ...keras.elastic import __all__  # noqa: F401
