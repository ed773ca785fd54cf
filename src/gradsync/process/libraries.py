"""Which shared libraries this process has already loaded, from ``/proc/self/maps`` (Linux).

gradsync asks before it loads a library of its own: :mod:`gradsync.process.launch` names the libmpi that
mpi4py loaded, and :mod:`gradsync.backends.nccl_api` takes the libnccl.so.2 that torch loaded instead of
loading a second NCCL from another file. This module imports no deep-learning framework.
"""

from __future__ import annotations

import re

MAPS = "/proc/self/maps"


def loaded_library(pattern: str, maps: str = MAPS) -> str | None:
    """The path of the first file mapped into this process whose path matches the regular
    expression ``pattern`` (``re.search``), e.g. ``r"/libnccl\\.so\\.2$"``; None when none matches or
    ``maps`` (default: this process's /proc/self/maps) cannot be read. Never raises."""
    try:
        with open(maps) as lines:
            for line in lines:
                fields = line.split(maxsplit=5)
                path = fields[5].strip() if len(fields) == 6 else ""
                if path.startswith("/") and re.search(pattern, path):
                    return path
    except OSError:
        return None
    return None
