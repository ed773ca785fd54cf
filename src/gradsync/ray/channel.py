"""The two local channels gradsync adds on a Ray node, both Unix sockets in a private directory.

* The *relay*: the MPI launcher's remote shell (:mod:`gradsync.ray.rsh`) asks the process that runs
  the launcher to start a launcher proxy inside the Ray actor of a node (:mod:`gradsync.ray.job`).
* The *hand-over*: the process the launcher starts for a rank (:mod:`gradsync.ray.stub`) hands its
  launch identity (the PMI or PMIx variables, and Hydra's PMI socket) to the actor that becomes
  that rank (:mod:`gradsync.ray.rank`).

Neither listens on the network. Each socket lives in a directory only its owner may enter (mode
0700) and every connection is authenticated with ``multiprocessing.connection``'s HMAC challenge
on a per-job random key, which reaches the actors through Ray's own calls and the launched
processes through the launcher's environment (:data:`AUTHKEY_ENV`). This module imports no Ray.
"""

from __future__ import annotations

import os
import tempfile
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path

#: The relay's socket, in the environment of the launcher and so of its remote shell.
RELAY_ENV = "GRADSYNC_RAY_RELAY"
#: The job's key (hex), in the same environment and so in every launched process.
AUTHKEY_ENV = "GRADSYNC_RAY_AUTHKEY"


def private_dir(prefix: str) -> Path:
    """A new directory under the system's temporary directory that only this user may enter."""
    return Path(tempfile.mkdtemp(prefix=prefix))  # mkdtemp creates it with mode 0700


def session_path(token: str) -> Path:
    """The directory of one job's hand-over sockets on this node (the same path on every node:
    the launched process finds it from the job's token on its command line)."""
    return Path(tempfile.gettempdir()) / f"gradsync-ray-{token}"


def session_dir(token: str) -> Path:
    """:func:`session_path`, created with mode 0700 where it does not exist yet.

    Raises:
        PermissionError: the directory exists and belongs to another user.
    """
    path = session_path(token)
    path.mkdir(mode=0o700, exist_ok=True)
    if path.stat().st_uid != os.getuid():
        raise PermissionError(f"gradsync.ray: {path} belongs to another user")
    os.chmod(path, 0o700)
    return path


def rank_socket(directory: str | Path, rank: int) -> str:
    """The hand-over socket of ``rank`` in a job's session directory."""
    return str(Path(directory) / f"rank-{rank}")


def listen(path: str, authkey: bytes) -> Listener:
    """A listener on the Unix socket ``path`` whose clients must know ``authkey``."""
    return Listener(address=path, family="AF_UNIX", authkey=authkey)


def connect(path: str, authkey: bytes) -> Connection:
    """A connection to the listener at ``path``, authenticated with ``authkey``.

    Raises:
        OSError: nothing listens there.
        multiprocessing.AuthenticationError: the listener has another key.
    """
    return Client(address=path, family="AF_UNIX", authkey=authkey)


def authkey_from_env() -> bytes:
    """The job's key from :data:`AUTHKEY_ENV`; ``KeyError`` when the variable is missing."""
    return bytes.fromhex(os.environ[AUTHKEY_ENV])
