"""``python -m gradsync.ray.stub SESSION``: the program the MPI launcher starts for each rank.

It does not become the rank. It hands its launch identity to the Ray actor that does: the
variables through which the launcher tells a process who it is (Hydra's PMI_RANK, PMI_SIZE and
PMI_FD socket; Open MPI's PMIX_* and OMPI_*), and Hydra's PMI socket itself, passed as a file
descriptor. The actor then initialises MPI with them and is rank r of the launcher's
``MPI_COMM_WORLD`` (:mod:`gradsync.ray.rank`). The stub stays, so that the launcher sees a live
rank, until the actor's process has ended: it exits 0 when the actor said it finalised MPI before
that, 1 otherwise (the actor died: the launcher then ends the job as for any rank that failed).
"""

from __future__ import annotations

import os
import sys
from multiprocessing.reduction import send_handle

from ..process.launch import detect_launcher
from . import channel

#: Variables a launcher sets for the process it starts (PMI-1/2 of Hydra and srun, PMIx, Open MPI).
LAUNCH_PREFIXES = ("PMI_", "PMIX_", "MPI_LOCAL", "MPIR_", "HYDRA_", "HYDI_", "OMPI_", "PRTE_", "OPAL_")
#: Variables passed along from the launcher's environment that the actor takes where it has none.
SETTING_PREFIXES = ("GRADSYNC_", "HOROVOD_")
FINALIZED = "finalized"


def identity(environ: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(the launch variables, the gradsync settings) of ``environ``; the Ray channel's own
    variables are neither."""
    launch = {k: v for k, v in environ.items() if k.startswith(LAUNCH_PREFIXES)}
    settings = {k: v for k, v in environ.items()
                if k.startswith(SETTING_PREFIXES) and not k.startswith("GRADSYNC_RAY_")}
    return launch, settings


def main(argv: list[str]) -> int:
    rank = detect_launcher().rank
    if rank is None or len(argv) != 1:
        print("gradsync.ray.stub: run by gradsync.ray's MPI launcher only", file=sys.stderr)
        return 2
    session = channel.session_path(argv[0])
    conn = channel.connect(channel.rank_socket(session, rank), channel.authkey_from_env())
    launch, settings = identity(dict(os.environ))
    pmi_fd = launch.get("PMI_FD")
    conn.send((launch, settings, pmi_fd is not None))
    if pmi_fd is not None:
        send_handle(conn, int(pmi_fd), None)
        os.close(int(pmi_fd))  # the actor holds it now; a copy here would outlive a dead actor
    finalized = False
    try:
        while True:
            finalized = conn.recv() == FINALIZED or finalized
    except (EOFError, OSError):
        pass
    return 0 if finalized else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
