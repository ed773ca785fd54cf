"""RayExecutor: Horovod's ``horovod.ray.RayExecutor`` API, on gradsync (docs/ray.md).

The executor places one Ray actor per worker in a placement group, makes the actors the ranks of
one MPI job (:class:`gradsync.ray.job.MpiJob`) and runs functions in them. Inside a function,
``gradsync.init()`` and the adapters (``gradsync.torch``, ``.tensorflow``, ``.keras``, ``.jax``)
see ranks 0..N-1 of that job; consecutive calls run in the same actors, on the same job.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import ray
import ray.actor
import ray.exceptions
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ..config import Config
from ..errors import GradsyncError
from . import job

log = logging.getLogger("gradsync")


class WorkerError(GradsyncError):
    """A function run by :class:`RayExecutor` failed on one or more ranks. The message names each
    failed rank with its traceback (or says that its worker process died); ``failures`` maps those
    ranks to their exceptions."""

    def __init__(self, message: str, failures: dict[int, BaseException]) -> None:
        super().__init__(message)
        self.failures = failures


@dataclasses.dataclass(frozen=True)
class Settings:
    """What :meth:`RayExecutor.create_settings` returns (Horovod's ``RayExecutor`` settings).

    ``timeout_s``: seconds to start the MPI job over the placed workers; ``placement_group_timeout_s``:
    seconds to wait for Ray to place every worker. ``ssh_identity_file``, ``ssh_str`` and ``nics`` are
    Horovod's and accepted for its callers; gradsync uses no ssh (the launcher reaches the nodes
    through Ray) and MPI picks the network.
    """

    timeout_s: float = 30.0
    placement_group_timeout_s: float = 100.0
    ssh_identity_file: str | None = None
    ssh_str: str | None = None
    nics: Any = None


class _Worker:
    """The actor of one worker (made a Ray actor class by :meth:`RayExecutor.start`)."""

    def __init__(self, env: dict[str, str]) -> None:
        os.environ.update(env)
        self.executable: Any = None

    def node(self) -> tuple[str, str]:
        return ray.get_runtime_context().get_node_id(), socket.gethostname()

    def execute(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    def make_executable(self, cls: type, args: list[Any], kwargs: dict[str, Any]) -> None:
        self.executable = cls(*args, **kwargs)

    def on_executable(self, fn: Callable[[Any], Any]) -> Any:
        return fn(self.executable)

    def exit(self) -> None:
        ray.actor.exit_actor()  # a normal exit: MPI's exit handlers run, then the launcher sees it


class RayExecutor:
    """Runs functions on N ranks of one gradsync (MPI) job placed by Ray; the API of
    ``horovod.ray.RayExecutor``.

    Give either ``num_workers`` (one bundle of ``cpus_per_worker`` CPUs and ``gpus_per_worker``
    GPUs per worker, placed with ``placement_strategy``, Horovod's default ``"PACK"``) or
    ``num_hosts`` and ``num_workers_per_host`` (one bundle per host holding its workers, placed
    ``"STRICT_SPREAD"``: one host each). Ranks are numbered node by node.

    Example::

        ray.init()
        executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=4)
        executor.start()
        ranks = executor.run(lambda: (gradsync.init(), gradsync.rank())[1])  # [0, 1, 2, 3]
        executor.shutdown()

    .. note:: Elastic training (Horovod's ``min_workers``/``max_workers``) is not offered: passing
       them raises ``NotImplementedError`` (docs/ray.md says why).
    """

    @staticmethod
    def create_settings(timeout_s: float = 30, ssh_identity_file: str | None = None,
                        ssh_str: str | None = None, placement_group_timeout_s: float = 100,
                        nics: Any = None) -> Settings:
        """Settings for :class:`RayExecutor`; same signature as Horovod's
        ``RayExecutor.create_settings``. ``timeout_s`` (seconds) bounds starting the MPI job,
        ``placement_group_timeout_s`` (seconds) waiting for Ray to place the workers."""
        return Settings(float(timeout_s), float(placement_group_timeout_s), ssh_identity_file,
                        ssh_str, nics)

    def __init__(self, settings: Settings, num_workers: int | None = None, num_hosts: int | None = None,
                 num_workers_per_host: int = 1, cpus_per_worker: float = 1, use_gpu: bool = False,
                 gpus_per_worker: float | None = None, use_current_placement_group: bool = True,
                 placement_strategy: str | None = None, cpus_per_slot: float | None = None,
                 gpus_per_slot: float | None = None, min_workers: int | None = None,
                 max_workers: int | None = None, **elastic: Any) -> None:
        """See the class doc. ``cpus_per_slot``/``gpus_per_slot`` are Horovod's older names of
        ``cpus_per_worker``/``gpus_per_worker``; ``use_current_placement_group`` is accepted and
        ignored (the executor always makes its own placement group).

        Raises:
            ValueError: neither or both of ``num_workers`` and ``num_hosts``, or a count below 1.
            NotImplementedError: the elastic arguments (``min_workers``, ``max_workers``, ...).
        """
        if min_workers is not None or max_workers is not None or elastic:
            raise NotImplementedError("gradsync.ray.RayExecutor does not run elastic jobs (min_workers, "
                                      "max_workers, ...): give num_workers, or num_hosts and "
                                      "num_workers_per_host (docs/ray.md)")
        if (num_workers is None) == (num_hosts is None):
            raise ValueError("give either num_workers, or num_hosts and num_workers_per_host")
        per_host = num_workers_per_host if num_hosts is not None else 1
        count = num_workers if num_workers is not None else num_hosts * per_host
        if count < 1 or per_host < 1:
            raise ValueError(f"a job needs at least one worker (got {count}, {per_host} per host)")
        self.settings = settings
        self.num_workers = count
        self.cpus_per_worker = cpus_per_slot if cpus_per_slot is not None else cpus_per_worker
        gpus = gpus_per_slot if gpus_per_slot is not None else gpus_per_worker
        self.gpus_per_worker = (gpus if gpus is not None else 1) if use_gpu else 0
        self.workers_per_bundle = per_host
        self.strategy = placement_strategy or ("STRICT_SPREAD" if num_hosts is not None else "PACK")
        self.workers: list[Any] = []  # actor handles, in rank order
        self.nodes: list[str] = []  # the Ray node id of each rank
        self._group = None
        self._job: job.MpiJob | None = None

    # ---- starting ------------------------------------------------------------------------------

    def _bundle(self) -> dict[str, float]:
        bundle = {"CPU": self.cpus_per_worker * self.workers_per_bundle}
        if self.gpus_per_worker:
            bundle["GPU"] = self.gpus_per_worker * self.workers_per_bundle
        return bundle

    def _place(self) -> None:
        count = self.num_workers // self.workers_per_bundle
        self._group = placement_group([self._bundle()] * count, strategy=self.strategy)
        ready, _ = ray.wait([self._group.ready()], timeout=self.settings.placement_group_timeout_s)
        if not ready:
            remove_placement_group(self._group)
            self._group = None
            raise GradsyncError(
                f"gradsync.ray: Ray could not place {self.num_workers} workers ({count} bundles of "
                f"{self._bundle()}, strategy {self.strategy}) within placement_group_timeout_s="
                f"{self.settings.placement_group_timeout_s:g} s; the cluster has "
                f"{ray.cluster_resources()} in all, {ray.available_resources()} free")

    def start(self, executable_cls: type | None = None, executable_args: list[Any] | None = None,
              executable_kwargs: dict[str, Any] | None = None,
              extra_env_vars: dict[str, str] | None = None) -> None:
        """Place the workers, start the MPI job over them and, given ``executable_cls``, create
        ``executable_cls(*executable_args, **executable_kwargs)`` in every worker (after MPI is up),
        for :meth:`execute`. ``extra_env_vars`` are set in each worker first. Same as
        ``horovod.ray.RayExecutor.start``.

        Raises:
            GradsyncError: the workers could not be placed within ``placement_group_timeout_s``,
                or the job did not start within ``timeout_s`` (nothing is left running then).
            WorkerError: ``executable_cls`` raised on some rank.
        """
        if self.workers:
            raise GradsyncError("gradsync.ray: this executor is started already")
        self._place()
        try:
            self._start_job(dict(extra_env_vars or {}))
        except BaseException:
            self.shutdown()
            raise
        if executable_cls is not None:
            self._gather([worker.make_executable.remote(executable_cls, list(executable_args or []),
                                                        dict(executable_kwargs or {}))
                          for worker in self.workers])

    def _start_job(self, env: dict[str, str]) -> None:
        actor = ray.remote(_Worker)
        per_bundle = self.workers_per_bundle
        workers = [actor.options(num_cpus=self.cpus_per_worker, num_gpus=self.gpus_per_worker,
                                 scheduling_strategy=PlacementGroupSchedulingStrategy(
                                     self._group, placement_group_bundle_index=i // per_bundle)).remote(env)
                   for i in range(self.num_workers)]
        self.workers = workers
        nodes, hostnames = zip(*ray.get([worker.node.remote() for worker in workers],
                                        timeout=self.settings.timeout_s))
        self._job = job.MpiJob(lambda i, fn, *args: workers[i].execute.remote(fn, *args), nodes, hostnames)
        order = sorted(range(len(workers)), key=lambda i: self._job.ranks[i])
        self.workers = [workers[i] for i in order]
        self.nodes = [nodes[i] for i in order]
        self._job.start(self.settings.timeout_s)

    # ---- running -------------------------------------------------------------------------------

    def _started(self) -> list[Any]:
        if not self.workers or self._job is None:
            raise GradsyncError("gradsync.ray: the executor is not started: call start() first")
        return self.workers

    def run_remote(self, fn: Callable[..., Any], args: list[Any] | None = None,
                   kwargs: dict[str, Any] | None = None) -> list[ray.ObjectRef]:
        """Start ``fn(*args, **kwargs)`` on every rank; returns one ``ray.ObjectRef`` per rank, in
        rank order. Same as ``horovod.ray.RayExecutor.run_remote``."""
        return [worker.execute.remote(fn, *(args or []), **(kwargs or {}))
                for worker in self._started()]

    def run(self, fn: Callable[..., Any], args: list[Any] | None = None,
            kwargs: dict[str, Any] | None = None, callbacks: Any = None) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank and return its results in rank order. Same
        as ``horovod.ray.RayExecutor.run`` (``callbacks`` is accepted and unused).

        Raises:
            WorkerError: ``fn`` raised on some ranks, or their worker processes died; the message
                names each such rank with its traceback. After a first failure the other ranks
                get the rank failure timeout (``GRADSYNC_RANK_FAILURE_TIMEOUT_SECONDS``) to end,
                as gradsync's failure detection makes them; ranks still running then are named
                too. :meth:`shutdown` ends them.
        """
        return self._gather(self.run_remote(fn, args, kwargs))

    def execute(self, fn: Callable[[Any], Any], callbacks: Any = None) -> list[Any]:
        """``fn(executable)`` on every rank, with the executable :meth:`start` created there;
        results in rank order. Same as ``horovod.ray.RayExecutor.execute``. Raises as :meth:`run`."""
        return self._gather([worker.on_executable.remote(fn) for worker in self._started()])

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(executable)`` on rank 0 only; its result. Same as
        ``horovod.ray.RayExecutor.execute_single``. Raises as :meth:`run`."""
        return self._gather([self._started()[0].on_executable.remote(fn)])[0]

    def _gather(self, refs: list[ray.ObjectRef]) -> list[Any]:
        pending, failures, deadline = list(refs), {}, None
        while pending:
            timeout = None if deadline is None else max(deadline - time.monotonic(), 0)
            done, pending = ray.wait(pending, num_returns=1, timeout=timeout)
            if not done:
                break
            try:
                ray.get(done[0])
            except Exception as error:  # noqa: BLE001 - reported with its rank below
                failures[refs.index(done[0])] = error
                if deadline is None:
                    deadline = time.monotonic() + _liveness_bound()
        if failures:
            running = [refs.index(ref) for ref in pending]
            raise WorkerError(_failure_report(failures, running, len(refs), self.nodes), failures)
        return ray.get(refs)

    # ---- stopping ------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """End the job and the workers: finalise MPI where the ranks still answer, kill the actors,
        remove the placement group and end the launcher; no process of the job is left. Same as
        ``horovod.ray.RayExecutor.shutdown``. Never raises for a job that already failed."""
        if self._job is not None:
            unfinished = self._job.finalize()
            if unfinished:
                log.info("gradsync.ray: ranks %s did not finalise MPI; killing them", unfinished)
        exits = [worker.exit.remote() for worker in self.workers]
        ray.wait(exits, num_returns=len(exits), timeout=job.STOP_GRACE_S)
        for worker in self.workers:
            ray.kill(worker)
        if self._job is not None:
            self._job.close()
        if self._group is not None:
            remove_placement_group(self._group)
        self.workers, self.nodes, self._job, self._group = [], [], None, None


def _liveness_bound() -> float:
    """How long the other ranks get to end after one failed: the rank failure timeout and a
    margin for Ray to report, in seconds."""
    timeout = Config.resolve({}).rank_failure_timeout_seconds
    return (timeout or 30.0) + 5.0


def _failure_report(failures: dict[int, BaseException], running: list[int], size: int,
                    nodes: list[str]) -> str:
    lines = [f"gradsync.ray: {len(failures)} of {size} ranks failed"]
    for number, error in sorted(failures.items()):
        where = f" (node {nodes[number][:16]})" if number < len(nodes) else ""
        if isinstance(error, ray.exceptions.RayActorError):
            lines.append(f"rank {number}{where}: its worker process died: {error}")
        else:
            lines.append(f"rank {number}{where} raised:\n{error}")
    if running:
        lines.append(f"ranks still running (call shutdown() to end them): {running}")
    return "\n".join(lines)
