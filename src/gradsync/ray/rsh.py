"""``python -m gradsync.ray.rsh [OPTIONS] HOST COMMAND...``: the remote shell of gradsync's MPI
launcher on Ray, in place of ``ssh`` (Hydra's ``-launcher-exec``, Open MPI's ``plm_ssh_agent``).

HOST is the name the launcher was given for a Ray node (:func:`gradsync.ray.job.host_name`). The
command goes over the relay socket (:mod:`gradsync.ray.channel`) to the process that runs the
launcher, which starts it in the Ray actor on that node (through Ray) and sends back its exit
status when it ends; this program exits with that status, as ssh does. Options before HOST (ssh's,
such as ``-x``) are ignored.
"""

from __future__ import annotations

import os
import sys

from . import channel


def main(argv: list[str]) -> int:
    while argv and argv[0].startswith("-"):
        argv = argv[1:]
    if len(argv) < 2 or channel.RELAY_ENV not in os.environ:
        print("gradsync.ray.rsh: run by gradsync.ray's MPI launcher only", file=sys.stderr)
        return 255
    conn = channel.connect(os.environ[channel.RELAY_ENV], channel.authkey_from_env())
    conn.send((argv[0], " ".join(argv[1:])))
    try:
        return int(conn.recv())
    except (EOFError, OSError):
        return 255


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
