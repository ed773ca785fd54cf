"""The process's gradsync runtime: init/shutdown, rank and topology, launcher detection.

``init()`` creates the one :class:`Runtime` object that holds every piece of process state (the
coordinator thread, its communicator, the configuration); ``shutdown()`` tears it down. No other
module keeps mutable state.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
from typing import Any

from .config import Config
from .coordinator import Coordinator
from .errors import GradsyncError, NotInitializedError

log = logging.getLogger("gradsync")


@dataclasses.dataclass(frozen=True)
class Launcher:
    """The launcher found in the environment and the number of processes it says it started."""

    name: str
    expected_size: int | None


def detect_launcher(environ: dict[str, str] | None = None) -> Launcher:
    """Which launcher started this process, from its environment variables.

    Recognises Open MPI's ``mpirun`` (OMPI_COMM_WORLD_SIZE), PMI launchers such as MPICH's Hydra
    ``mpiexec`` and ``srun --mpi=pmi2`` (PMI_SIZE), and SLURM ``srun`` job steps
    (SLURM_STEP_NUM_TASKS). Returns ``Launcher("none", None)`` for a plain process.
    """
    env = os.environ if environ is None else environ
    for variable, name in (("OMPI_COMM_WORLD_SIZE", "Open MPI mpirun/mpiexec"),
                           ("PMI_SIZE", "PMI (MPICH mpiexec or srun --mpi=pmi2)"),
                           ("SLURM_STEP_NUM_TASKS", "SLURM srun")):
        if variable in env:
            try:
                return Launcher(name, int(env[variable]))
            except ValueError:
                continue
    return Launcher("none", None)


class Runtime:
    """Everything ``init()`` sets up for this process; see :func:`init`."""

    def __init__(self, config: Config, world) -> None:
        from mpi4py import MPI

        self.config = config
        self.pid = os.getpid()
        self.launcher = detect_launcher()
        self.rank = world.Get_rank()
        self.size = world.Get_size()
        local = world.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank, self.local_size = local.Get_rank(), local.Get_size()
        cross = world.Split(color=self.local_rank, key=self.rank)
        self.cross_rank, self.cross_size = cross.Get_rank(), cross.Get_size()
        local.Free()
        cross.Free()
        self.comm = world.Dup()  # the coordinator's own communicator: no other thread uses it
        self._unnamed: dict[str, int] = {}
        self.coordinator = Coordinator(self.comm, config)

    def auto_name(self, kind: str) -> str:
        """A name for an unnamed collective: the kind and how many unnamed ones of it came before."""
        count = self._unnamed.get(kind, 0)
        self._unnamed[kind] = count + 1
        return f"{kind}.noname.{count}"


_runtime: Runtime | None = None


def init(comm: Any = None, **settings: Any) -> None:
    """Initialise gradsync: start MPI (if needed) and the background coordinator thread.

    Call once per process, before any other gradsync function; a second call is a no-op. Works
    under ``mpiexec``/``mpirun`` (Open MPI, MPICH), SLURM ``srun``, and as a plain single process
    (size 1). Collective over ``comm``: every rank must call it.

    Args:
        comm: the mpi4py communicator whose ranks take part (default ``MPI.COMM_WORLD``).
            gradsync duplicates it, so your own traffic on it never mixes with gradsync's.
        **settings: overrides of the ``GRADSYNC_*`` environment variables, by lower-case name
            without prefix, e.g. ``fusion_threshold=4 << 20`` (bytes), ``cycle_time=2.0`` (ms);
            see docs/configuration.md.

    Raises:
        TypeError: an unknown setting.
        ValueError: a setting that does not parse.
        GradsyncError: MPI does not provide MPI_THREAD_MULTIPLE, or the launcher started N
            processes but MPI sees a world of 1 (a launcher/MPI mismatch; the message says the fix).
    """
    global _runtime
    if _runtime is not None and _runtime.pid == os.getpid():
        return
    config = Config.resolve(settings)
    logging.getLogger("gradsync").setLevel(config.log_level.upper())
    # Open MPI busy-polls in blocking calls unless told to yield; the coordinator waits in them
    # while the training thread needs the core (PERF-NOTES.md fact 1). Must precede MPI_Init.
    os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    from mpi4py import MPI

    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise GradsyncError(
            "gradsync needs MPI_THREAD_MULTIPLE (its coordinator thread calls MPI while your code "
            f"may too), but MPI was initialised with thread level {MPI.Query_thread()}; do not set "
            "mpi4py.rc.thread_level, or initialise MPI with MPI_THREAD_MULTIPLE")
    world = MPI.COMM_WORLD if comm is None else comm
    launcher = detect_launcher()
    if comm is None and launcher.expected_size not in (None, world.Get_size()):
        raise GradsyncError(
            f"gradsync: the launcher ({launcher.name}) started {launcher.expected_size} processes "
            f"but MPI sees a world of {world.Get_size()}: every process would train alone. The MPI "
            "library and the launcher do not match: with srun use --mpi=pmix for Open MPI and "
            "--mpi=pmi2 for MPICH; with mpiexec use the one installed with your mpi4py's MPI "
            f"({MPI.Get_library_version().splitlines()[0].strip()}).")
    _runtime = Runtime(config, world)
    atexit.unregister(shutdown)
    atexit.register(shutdown)
    log.debug("gradsync: rank %d of %d initialised (%s)", _runtime.rank, _runtime.size,
              launcher.name)


def shutdown() -> None:
    """Stop the coordinator on every rank; pending collectives fail with ShutdownError.

    Waits up to ``GRADSYNC_SHUTDOWN_TIMEOUT`` seconds for the other ranks to reach shutdown (or to
    submit anything). Safe to call twice, and called automatically at interpreter exit. ``init()``
    may be called again afterwards. Does not finalise MPI (mpi4py does that at exit).
    """
    global _runtime
    runtime, _runtime = _runtime, None
    if runtime is None or runtime.pid != os.getpid():
        return
    if runtime.coordinator.shutdown(runtime.config.shutdown_timeout):
        runtime.comm.Free()
    else:
        log.warning("gradsync: rank %d: the other ranks did not reach shutdown within %.0f s; "
                    "leaving the coordinator thread behind", runtime.rank,
                    runtime.config.shutdown_timeout)


def get() -> Runtime:
    """The runtime of this process.

    Raises:
        NotInitializedError: ``init()`` was not called (or ``shutdown()`` was).
        GradsyncError: this process was forked from an initialised one (a DataLoader worker, say).
    """
    runtime = _runtime
    if runtime is None:
        raise NotInitializedError("gradsync is not initialised: call gradsync.init() first")
    if runtime.pid != os.getpid():
        raise GradsyncError(
            f"gradsync: process {os.getpid()} was forked from rank {runtime.rank} (pid "
            f"{runtime.pid}) after gradsync.init(); a forked child (such as a DataLoader worker) "
            "cannot run collectives: call gradsync only from the main process")
    return runtime


def is_initialized() -> bool:
    """True between ``init()`` and ``shutdown()`` in this process."""
    return _runtime is not None and _runtime.pid == os.getpid()


def rank() -> int:
    """This process's rank in the world, 0 .. size()-1. Raises NotInitializedError before init()."""
    return get().rank


def size() -> int:
    """Number of processes in the world (world size). Raises NotInitializedError before init()."""
    return get().size


def local_rank() -> int:
    """Rank among the processes on this host (shared-memory node): use it to pick the GPU."""
    return get().local_rank


def local_size() -> int:
    """Number of processes on this host."""
    return get().local_size


def cross_rank() -> int:
    """Rank of this host among the hosts (the rank among processes of the same local_rank)."""
    return get().cross_rank


def cross_size() -> int:
    """Number of hosts (processes with the same local_rank across the job)."""
    return get().cross_size
