"""A torchrun script on gradsync's backend: ``init_process_group(backend="gradsync")`` in a
process that torchrun, not an MPI launcher, started. Reports the error each process gets."""

import os

import torch.distributed as dist
from report import report

import gradsync.torch  # noqa: F401 - registers the backend

try:
    dist.init_process_group(backend="gradsync")
    error = None
except Exception as caught:  # noqa: BLE001 - the test asserts on what it is
    error = f"{type(caught).__name__}: {caught}"
report(rank=int(os.environ["RANK"]), error=error)
