"""Calls gradsync.init() and reports the outcome (tests/workers/report.py): ``rank`` and ``size``
as gradsync sees them, or, when init() raised GradsyncError, ``error`` and the rank the launcher
gave (``rank``, from its environment; -1 when it set none) with ``size`` null.

Also prints the error as ``GradsyncError: <message>`` for a reader of the job's output, and exits
with status 3 then, so a test can tell the library's own, clear error from a crash.
"""

import os
import sys

from report import report

import gradsync

_LAUNCHER_RANK = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")

try:
    gradsync.init()
except gradsync.GradsyncError as exc:
    launcher_rank = next((int(os.environ[v]) for v in _LAUNCHER_RANK if v in os.environ), -1)
    print(f"GradsyncError: {exc}", flush=True)
    report(rank=launcher_rank, size=None, error=str(exc))
    sys.exit(3)
report(rank=gradsync.rank(), size=gradsync.size(), error=None)
gradsync.shutdown()
