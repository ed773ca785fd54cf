"""Prints each rank's place in the job as gradsync sees it, and as the launcher and the OS say.

One line per rank, in one write: ``topology rank=R size=N host=H local=L/LS cross=C/CS
launcher=NAME slurm_procid=P slurm_localid=Q``. The test compares these with the layout it asked
the launcher for (hosts from ``socket.gethostname()``, SLURM's own task ids): an independent
reference for local_rank/local_size/cross_rank/cross_size.
"""

import os
import socket
import sys

import gradsync
from gradsync.process import runtime

gradsync.init()
# Every rank runs one collective, so a rank that is not part of the same job shows up as a hang.
gradsync.barrier()
sys.stdout.write(
    f"topology rank={gradsync.rank()} size={gradsync.size()} host={socket.gethostname()} "
    f"local={gradsync.local_rank()}/{gradsync.local_size()} "
    f"cross={gradsync.cross_rank()}/{gradsync.cross_size()} "
    f"launcher={runtime.get().launcher.name.replace(' ', '_')} "
    f"slurm_procid={os.environ.get('SLURM_PROCID', '-')} "
    f"slurm_localid={os.environ.get('SLURM_LOCALID', '-')}\n")
sys.stdout.flush()
gradsync.shutdown()
