"""``horovod.tensorflow.keras``'s path for :mod:`gradsync.keras`: ``import gradsync.tensorflow.keras as
hvd`` is ``import gradsync.keras as hvd`` (the same functions and classes, not copies), so a Horovod
script ported by changing ``horovod`` to ``gradsync`` in its imports runs. Keras 3 on any backend:
see docs/keras.md."""

from __future__ import annotations

from ...keras import *  # noqa: F403 - the same names as gradsync.keras
from ...keras import __all__  # noqa: F401
from . import callbacks, elastic  # noqa: F401 - this path's submodules, as Horovod's
