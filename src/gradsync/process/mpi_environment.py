"""MPI settings that must be in the environment before MPI initialises, set at ``import gradsync``.

Open MPI busy-polls in blocking calls unless told to yield; gradsync's coordinator thread waits in
them while the training thread needs the core (docs/performance-notes.md, facts 1 and 11). The
variable must be in the environment before ``MPI_Init``: in ``gradsync.init()``
(gradsync.process.launch.start_mpi), or at the user's own import of ``mpi4py.MPI``, which may come
after ``import gradsync``. So ``import gradsync`` sets it, first, and only where the user has not
set it. (Importing gradsync imports no ``mpi4py.MPI`` itself: that import initialises MPI, before
``init()`` could check the launch.)
``init()`` logs what Open MPI waits with, and who chose it (:func:`gradsync.process.launch.waiting_note`).
"""

from __future__ import annotations

import os

OPEN_MPI_YIELD = "OMPI_MCA_mpi_yield_when_idle"
YIELD_SET_BY_GRADSYNC = OPEN_MPI_YIELD not in os.environ  # read by init() for its start-up line
os.environ.setdefault(OPEN_MPI_YIELD, "1")
