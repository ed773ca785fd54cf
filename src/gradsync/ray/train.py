"""A Ray Train backend: gradsync's collectives in ``DataParallelTrainer`` (docs/ray.md).

``DataParallelTrainer(train_loop_per_worker, backend_config=GradsyncConfig(),
scaling_config=ScalingConfig(num_workers=N))`` starts one MPI job over Ray Train's N workers before
the training loop runs (:class:`gradsync.ray.job.MpiJob`, as :class:`~gradsync.ray.RayExecutor`
does): in the loop, ``gradsync.init()`` and the adapters see ranks 0..N-1, numbered as Ray Train's
world ranks, and ``ray.train.report`` and checkpoints work as with any backend. This is the shape of
Ray's removed ``HorovodTrainer``/``HorovodConfig``: ``HorovodTrainer(loop, horovod_config=...)``
becomes ``DataParallelTrainer(loop, backend_config=GradsyncConfig(...))``.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from ray.train.backend import Backend, BackendConfig

from . import job

log = logging.getLogger("gradsync")


@dataclasses.dataclass
class GradsyncConfig(BackendConfig):
    """The ``backend_config`` that makes Ray Train's workers ranks of one gradsync (MPI) job.

    Args:
        timeout_s: seconds to start the MPI job over the workers (``GradsyncError`` past it).

    The other fields (``nics``, ``verbose``, ``key``, ``ssh_port``, ``ssh_identity_file``,
    ``ssh_str``, ``placement_group_timeout_s``) are those of Ray's ``HorovodConfig``, accepted so
    that its callers run unchanged, and unused: no ssh (the launcher reaches the nodes through
    Ray), MPI picks the network, Ray Train places the workers.
    """

    timeout_s: int = 300
    nics: Any = None
    verbose: int = 1
    key: str | None = None
    ssh_port: int | None = None
    ssh_identity_file: str | None = None
    ssh_str: str | None = None
    placement_group_timeout_s: int = 100

    @property
    def backend_cls(self) -> type[Backend]:
        return _GradsyncBackend


def _workers(worker_group: Any) -> list[Any]:
    """The workers of Ray Train's worker group, in world-rank order (Train v2 and v1)."""
    getter = getattr(worker_group, "get_workers", None)
    return list(getter() if getter is not None else worker_group.workers)


class _GradsyncBackend(Backend):
    """Starts the MPI job when the workers are up (``on_start``), ends it at ``on_shutdown``."""

    def __init__(self) -> None:
        self._jobs: dict[int, job.MpiJob] = {}  # by worker group: one Backend serves them all

    def on_start(self, worker_group: Any, backend_config: GradsyncConfig) -> None:
        workers = _workers(worker_group)
        mpi_job = job.MpiJob(lambda i, fn, *args: worker_group.execute_single_async(i, fn, *args),
                             [worker.metadata.node_id for worker in workers],
                             [worker.metadata.hostname for worker in workers])
        if mpi_job.ranks != list(range(len(workers))):
            log.warning("gradsync.ray: Ray Train's workers are not listed node by node; gradsync's "
                        "ranks %s differ from Ray Train's world ranks", mpi_job.ranks)
        mpi_job.start(backend_config.timeout_s)
        self._jobs[id(worker_group)] = mpi_job

    def on_shutdown(self, worker_group: Any, backend_config: GradsyncConfig) -> None:
        mpi_job = self._jobs.pop(id(worker_group), None)
        if mpi_job is None:
            return
        unfinished = mpi_job.finalize()
        if unfinished:
            log.info("gradsync.ray: ranks %s did not finalise MPI", unfinished)
        # Ray Train ends the workers' processes after this returns, without their exit handlers:
        # end the launcher's proxies and the launcher now rather than have them see the workers die.
        mpi_job.stop_proxies()
        mpi_job.close(wait=0)
