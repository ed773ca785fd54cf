"""gradsync on Ray (docs/ray.md): Horovod's ``RayExecutor`` and a Ray Train backend.

* :class:`RayExecutor` (``horovod.ray.RayExecutor``'s API) places N workers with a Ray placement
  group and runs functions on them as ranks 0..N-1 of one MPI job.
* :class:`GradsyncConfig`, the ``backend_config`` of Ray Train's ``DataParallelTrainer``
  (the shape of the removed ``HorovodConfig``): ``train_loop_per_worker`` runs on ranks of one
  MPI job and uses gradsync's collectives, with Ray Train's report and checkpoints.

Ray places the ranks; MPI still carries the data. Needs ``pip install gradsync[ray]``. The modules
that the MPI launcher runs on the nodes (``rsh``, ``stub``) import no Ray, so this package imports
Ray only when one of the names above is used.
"""

from __future__ import annotations

from typing import Any

__all__ = ["GradsyncConfig", "RayExecutor", "Settings", "WorkerError"]


def __getattr__(name: str) -> Any:
    if name in ("RayExecutor", "Settings", "WorkerError"):
        from . import executor

        return getattr(executor, name)
    if name == "GradsyncConfig":
        from .train import GradsyncConfig

        return GradsyncConfig
    raise AttributeError(f"module 'gradsync.ray' has no attribute {name!r}")
