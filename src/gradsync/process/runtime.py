"""The process's gradsync runtime: init/shutdown, rank and topology.

``init()`` creates the one :class:`Runtime` object that holds every piece of process state (the
coordinator thread, its communicator, the configuration); ``shutdown()`` tears it down. No other
module keeps mutable state.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import sys
import time
from typing import TYPE_CHECKING, Any

from ..config import Config
from ..errors import GradsyncError, NotInitializedError
from . import launch, mpi_environment

if TYPE_CHECKING:  # imported by init() only: they import mpi4py.MPI, which initialises MPI
    from ..backends.mpi import MpiBackend
    from ..engine.coordinator import Coordinator
    from .key_value_store import KeyValueStore

log = logging.getLogger("gradsync")

#: The first id of the process sets registered by their members only (add_member_process_set).
MEMBER_SET_IDS = 1 << 20


@dataclasses.dataclass(frozen=True)
class ProcessSetState:
    """One registered process set on this rank: the :class:`~gradsync.ProcessSet` object (None for
    the global set, which is every rank), its coordinator (None where this rank is not a member)
    and its communicator (None likewise)."""

    process_set: Any
    coordinator: Coordinator | None
    comm: Any


class Runtime:
    """Everything ``init()`` sets up for this process; see :func:`init`."""

    def __init__(self, config: Config, world) -> None:
        from mpi4py import MPI

        from ..engine.coordinator import Coordinator
        from ..executors.device import GpuClaims

        self.config = config
        self.pid = os.getpid()
        #: True in a process forked from this one (set by :func:`_forked`, after ``os.fork()`` in
        #: the child): the runtime belongs to the parent, and this process may not use it.
        self.forked = False
        self.launcher = launch.detect_launcher()
        self.rank = world.Get_rank()
        self.size = world.Get_size()
        # Topology: the ranks sharing this host's memory, and the ranks of equal local rank.
        local = world.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank, self.local_size = local.Get_rank(), local.Get_size()
        cross = world.Split(color=self.local_rank, key=self.rank)
        self.cross_rank, self.cross_size = cross.Get_rank(), cross.Get_size()
        # Every host runs the same number of ranks (Horovod's is_homogeneous()).
        self.homogeneous = len(set(world.allgather(self.local_size))) == 1
        self.comm = world.Dup()  # the coordinator's own communicator: no other thread uses it
        # The user thread's communicator, for registering process sets (collective over all ranks).
        self.control = world.Dup()
        self._key_value_store: KeyValueStore | None = None
        self.backend = self._data_backend(local, cross)
        self._unnamed: dict[tuple[int, str], int] = {}
        self.gpu_claims = GpuClaims()  # which process set drives NCCL on each GPU
        self.coordinator = Coordinator(self.comm, config, backend=self.backend,
                                       gpu_claims=self.gpu_claims)
        self.process_sets: dict[int, ProcessSetState] = {
            0: ProcessSetState(None, self.coordinator, self.comm)}
        self._next_set_id = 1
        self.coordinator.neighbours = self._coordinators
        self.coordinator.start()
        log.debug("gradsync: rank %d: local %d/%d, cross %d/%d, allreduce %s", self.rank,
                  self.local_rank, self.local_size, self.cross_rank, self.cross_size,
                  self.backend.describe())

    def _data_backend(self, local, cross) -> MpiBackend:
        """The coordinator's data mover. A hierarchical allreduce keeps ``local`` and, on local rank
        0, ``cross``: from here on only the coordinator thread uses them, and shutdown frees them."""
        from ..backends.mpi import MpiBackend

        if not self.config.hierarchical_allreduce:
            local.Free()
            cross.Free()
            return MpiBackend(self.comm, shared=_shared_memory(self.comm, self.config))
        if self.local_rank != 0:
            cross.Free()
            cross = None
        return MpiBackend(self.comm, local=local, cross=cross)

    def key_value_store(self) -> KeyValueStore:
        """The key-value store every rank sees (:mod:`.key_value_store`; torch.distributed's
        rendezvous hands it to torch). Collective on its first call, which makes it: every rank
        must call it, in the same order as its other collective calls on the user thread's
        communicator (new process sets, torch groups); then the same object, until shutdown."""
        if self._key_value_store is None:
            from .key_value_store import KeyValueStore

            self._key_value_store = KeyValueStore(self.control.Dup(), self.rank)
        return self._key_value_store

    def _coordinators(self) -> list[Coordinator]:
        return [state.coordinator for state in list(self.process_sets.values())
                if state.coordinator is not None]

    def auto_name(self, kind: str, process_set_id: int = 0) -> str:
        """A name for an unnamed collective: the kind and how many unnamed ones of it came before
        on the same process set (so that ranks outside a set do not shift the count)."""
        key = (process_set_id, kind)
        count = self._unnamed.get(key, 0)
        self._unnamed[key] = count + 1
        return f"{kind}.noname.{count}"

    def _state(self, process_set: Any) -> ProcessSetState | None:
        """The registration of ``process_set`` (a :class:`~gradsync.ProcessSet`), or None."""
        ident = process_set.process_set_id
        state = self.process_sets.get(ident) if ident is not None else None
        if state is None or (ident != 0 and state.process_set is not process_set):
            return None
        return state

    def coordinator_for(self, process_set: Any, where: str) -> Coordinator:
        """The coordinator that runs collectives on ``process_set`` on this rank.

        Raises:
            ValueError: the set is not registered, or this rank is not a member (``where`` starts
                the message, naming the op and tensor).
        """
        state = self._state(process_set)
        if state is None:
            raise ValueError(f"{where}: {process_set} is not registered: call "
                             "gradsync.add_process_set() on every rank first")
        if state.coordinator is None:
            raise ValueError(f"{where}: rank {self.rank} is not a member of {process_set}; only its "
                             "members may run collectives on it (guard the call with "
                             "`if process_set.included():`)")
        return state.coordinator

    def replace_timelines(self, path: str, mark_cycles: bool = True) -> None:
        """Write the timeline of every process set this rank belongs to to ``path`` from now on, as
        ``GRADSYNC_TIMELINE=path`` would have at init (rank 0 alone unless ``{rank}`` is in it;
        ``.set<id>`` appended for other sets); ``path=""`` stops writing. Closes the files written
        so far. ``mark_cycles=False`` leaves out the CYCLE markers."""
        from ..timeline import open_for

        for ident, state in list(self.process_sets.items()):
            if state.coordinator is not None:
                state.coordinator.replace_timeline(
                    open_for(path, ident, state.coordinator.world_rank, mark_cycles))

    def add_process_set(self, process_set: Any) -> Any:
        """See :func:`gradsync.add_process_set` (``process_set``: a :class:`~gradsync.ProcessSet`)."""
        from mpi4py import MPI

        where = f"gradsync: rank {self.rank}: add_process_set"
        if process_set.process_set_id is not None:
            raise ValueError(f"{where}: {process_set} is already registered")
        outside = [r for r in process_set.ranks if r >= self.size]
        everyone = self.control.allgather(process_set.ranks)
        if any(ranks != process_set.ranks for ranks in everyone):
            listed = ", ".join(f"rank {r}: {ranks}" for r, ranks in enumerate(everyone))
            raise ValueError(f"{where}: ranks called it with different process sets: {listed}")
        if outside:
            raise ValueError(f"{where}: ranks {outside} of {process_set.ranks} are not ranks of this "
                             f"job (0 .. {self.size - 1})")
        for ident, state in list(self.process_sets.items())[1:]:
            other = state.process_set
            if ident < MEMBER_SET_IDS and other.ranks == process_set.ranks:  # members' sets: not all know
                raise ValueError(f"{where}: {other} already has the ranks {process_set.ranks}")
        member = self.rank in process_set.ranks
        comm = self.control.Split(0 if member else MPI.UNDEFINED, key=self.rank)
        ident = self._next_set_id
        self._next_set_id += 1
        return self._register(process_set, ident, comm if member else None)

    def add_member_process_set(self, process_set: Any) -> Any:
        """Register ``process_set`` collectively over its members only (MPI_Comm_create_group), for
        front doors whose non-members never hear of the set (a torch.distributed ``new_group``). Its
        id comes from a range of its own (``MEMBER_SET_IDS`` up), so that the ids of the sets that
        :meth:`add_process_set` registers stay equal on every rank, and :meth:`add_process_set` may
        register the same ranks again (the other ranks do not know this set); freed at shutdown.
        The members agree on the id (the largest of their next free ones, one allreduce on the new
        communicator), so that messages name the set alike on every member even when sets overlap."""
        from mpi4py import MPI

        group = self.control.Get_group().Incl(process_set.ranks)
        comm = self.control.Create_group(group)
        group.Free()
        mine = max((i + 1 for i in self.process_sets if i >= MEMBER_SET_IDS), default=MEMBER_SET_IDS)
        return self._register(process_set, comm.allreduce(mine, op=MPI.MAX), comm)

    def _register(self, process_set: Any, ident: int, comm: Any) -> Any:
        """Give ``process_set`` the id ``ident`` and, with ``comm`` (None: not a member), a coordinator."""
        from ..backends.mpi import MpiBackend
        from ..engine.coordinator import Coordinator

        coordinator = None
        if comm is not None:
            backend = MpiBackend(comm, shared=_shared_memory(comm, self.config))
            coordinator = Coordinator(comm, self.config, backend=backend,
                                      world_ranks=list(process_set.ranks), process_set_id=ident,
                                      gpu_claims=self.gpu_claims)
            coordinator.neighbours = self._coordinators
            coordinator.start()
        process_set.process_set_id = ident
        self.process_sets[ident] = ProcessSetState(process_set, coordinator, comm)
        return process_set

    def remove_process_set(self, process_set: Any) -> None:
        """See :func:`gradsync.remove_process_set`."""
        where = f"gradsync: rank {self.rank}: remove_process_set"
        ident = process_set.process_set_id
        if ident == 0:
            raise ValueError(f"{where}: the global process set cannot be removed")
        state = self._state(process_set)
        if state is None:
            raise ValueError(f"{where}: {process_set} is not registered")
        everyone = self.control.allgather(ident)
        if any(other != ident for other in everyone):
            listed = ", ".join(f"rank {r}: {i}" for r, i in enumerate(everyone))
            raise ValueError(f"{where}: ranks removed different process sets (ids): {listed}")
        del self.process_sets[ident]
        process_set.process_set_id = None
        _stop_coordinator(self, state.coordinator, state.comm)


_runtime: Runtime | None = None
#: Whether a runtime of this process was shut down (and none started since): for get()'s message.
_was_shut_down = False


def init(comm: Any = None, process_sets: list[Any] | None = None, **settings: Any) -> None:
    """Initialise gradsync: start MPI (if needed) and the background coordinator thread.

    Call once per process, before any other gradsync function; a second call is a no-op. Works
    under ``mpiexec``/``mpirun`` (Open MPI, MPICH), SLURM ``srun``, and as a plain single process
    (size 1). Collective over ``comm``: every rank must call it.

    Args:
        comm: the mpi4py communicator whose ranks take part (default ``MPI.COMM_WORLD``).
            gradsync duplicates it, so your own traffic on it never mixes with gradsync's.
        process_sets: :class:`~gradsync.ProcessSet` objects to register right away, in this order
            (the same as calling :func:`~gradsync.add_process_set` for each).
        **settings: overrides of the ``GRADSYNC_*`` environment variables, by lower-case name
            without prefix, e.g. ``fusion_threshold=4 << 20`` (bytes), ``cycle_time=2.0`` (ms);
            see docs/configuration.md.

    Rank 0 logs one line: the number of ranks and hosts, the MPI library and the launcher; at
    WARNING level for one rank started without a launcher (it trains alone), at INFO otherwise, on
    the ``gradsync.process.launch`` logger, which shows INFO by default (docs/launching.md).

    Raises:
        TypeError: an unknown setting.
        ValueError: a setting that does not parse.
        LaunchError: the launcher and the MPI library mpi4py loads cannot work together, found
            before ``MPI_Init`` (see :func:`gradsync.process.launch.diagnose`; the message names both and
            the fix).
        GradsyncError: MPI does not provide MPI_THREAD_MULTIPLE, or the launcher started N
            processes but MPI sees a world of 1 (a launcher/MPI mismatch; the message says the fix).
    """
    global _runtime, _was_shut_down
    if _runtime is not None and not _runtime.forked:
        return
    started = (time.time(), time.process_time())
    config = Config.resolve(settings)
    _configure_logging(config.log_level)
    world, launcher, library = _start_mpi(comm)
    _runtime = Runtime(config, world)
    _was_shut_down = False
    # Wall clock and this process's CPU seconds at the start and end, for the elastic recovery's phases.
    _runtime.init_times = (started, (time.time(), time.process_time()))
    atexit.unregister(shutdown)
    atexit.register(shutdown)
    for process_set in process_sets or ():
        _runtime.add_process_set(process_set)
    if _runtime.rank == 0:  # rank 0 has local rank 0: its cross communicator has one rank per host
        _log_start(_runtime, library, launcher)


def _start_mpi(comm: Any) -> tuple[Any, launch.Launcher, launch.MpiLibrary]:
    """:func:`init`'s first step: start MPI (if needed) and check that gradsync can run on it;
    returns the world (``comm``, default ``MPI.COMM_WORLD``), the launcher and the MPI library.

    Raises:
        LaunchError, GradsyncError: as :func:`init`.
    """
    MPI = launch.start_mpi()
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise GradsyncError(
            "gradsync needs MPI_THREAD_MULTIPLE (its coordinator thread calls MPI while your code "
            f"may too), but MPI was initialised with thread level {MPI.Query_thread()}; do not set "
            "mpi4py.rc.thread_level, or initialise MPI with MPI_THREAD_MULTIPLE")
    world = MPI.COMM_WORLD if comm is None else comm
    launcher, library = launch.detect_launcher(), launch.mpi_library(MPI)
    if comm is None:
        mismatch = launch.launcher_mismatch(launcher, world.Get_size(), library)
        if mismatch:
            raise GradsyncError(mismatch)
        launch.warn_if_batch_script_without_srun(launcher, world.Get_size())
    return world, launcher, library


def _log_start(runtime: Runtime, library: launch.MpiLibrary, launcher: launch.Launcher) -> None:
    """:func:`init`'s last step on rank 0: the start-up line (ranks, hosts, MPI, launcher, waits)."""
    level, line = launch.launch_line(runtime.size, runtime.cross_size, library, launcher)
    waits = launch.waiting_note(library, runtime.config.wait_policy,
                                set_by_gradsync=mpi_environment.YIELD_SET_BY_GRADSYNC)
    logging.getLogger("gradsync.launch").log(level, "%s; %s", line, waits)


class _RankFilter(logging.Filter):
    """Puts this process's rank (or '?' before init) into every record, for the default handler."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.gradsync_rank = _runtime.rank if _runtime is not None else "?"
        return True


def _configure_logging(level: str) -> None:
    """Set the gradsync logger's level; give it a stderr handler with the rank if nobody configured
    logging (otherwise INFO and DEBUG messages would go nowhere). The ``gradsync.process.launch`` logger (the
    start-up line) shows INFO too unless the level is above WARNING."""
    logger = logging.getLogger("gradsync")
    logger.setLevel(level.upper())
    threshold = logger.level
    logging.getLogger("gradsync.launch").setLevel(
        threshold if threshold > logging.WARNING else min(threshold, logging.INFO))
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.addFilter(_RankFilter())
        handler.setFormatter(logging.Formatter("[gradsync rank %(gradsync_rank)s] %(levelname)s: "
                                               "%(message)s"))
        logger.addHandler(handler)
        logger.propagate = False


def shutdown() -> None:
    """Stop the coordinator on every rank; pending collectives fail with ShutdownError.

    Waits up to ``GRADSYNC_SHUTDOWN_TIMEOUT`` seconds for the other ranks to reach shutdown (or to
    submit anything). Safe to call twice, and called automatically at interpreter exit. ``init()``
    may be called again afterwards. Does not finalise MPI (mpi4py does that at exit).

    After a rank was lost or a coordinator failed (:class:`~gradsync.RankFailureError`, or the
    "background coordinator failed" error), MPI cannot finish cleanly: ``MPI_Finalize`` would wait
    for the lost rank forever. Then shutdown logs why and calls ``MPI_Abort(MPI_COMM_WORLD, 1)``,
    which ends this process and the job with a non-zero exit status; standard output and error are
    flushed first. Under Open MPI's ULFM (``mpiexec --with-ft ulfm``), whose launcher can hang on
    MPI_Abort after a process failure, the process exits with status 1 instead, which ends the job
    there too.
    """
    global _runtime, _was_shut_down
    runtime, _runtime = _runtime, None
    if runtime is None or runtime.forked:
        return
    _was_shut_down = True
    failures = [state.coordinator.failure for state in runtime.process_sets.values()
                if state.coordinator is not None and state.coordinator.failure is not None]
    if failures:
        _abort(runtime, failures[0])
    for ident, state in sorted(runtime.process_sets.items(), reverse=True):
        if ident:
            state.process_set.process_set_id = None
        _stop_coordinator(runtime, state.coordinator, state.comm)
    runtime.process_sets.clear()
    if runtime._key_value_store is not None:
        runtime._key_value_store.close()
    runtime.control.Free()


def _stop_coordinator(runtime: Runtime, coordinator: Coordinator | None, comm) -> None:
    """Stop one process set's coordinator (None: this rank is not a member) and free what it owned."""
    if coordinator is None:
        return
    if coordinator.shutdown(runtime.config.shutdown_timeout):
        coordinator.host.backend.close()
        coordinator.negotiator.close()
        comm.Free()
    else:
        log.warning("gradsync: rank %d: the other ranks did not reach shutdown within %.0f s; "
                    "leaving the coordinator thread behind", runtime.rank,
                    runtime.config.shutdown_timeout)


def _shared_memory(comm, config: Config):
    """The shared memory of a process set's flat allreduce (gradsync.backends.shared), or None;
    collective over ``comm``, before its coordinator starts."""
    from ..backends.shared import open_shared

    return open_shared(comm, config.shared_memory_bytes, config.shared_memory_threshold)


def _abort(runtime: Runtime, failure: str) -> None:
    log.error("gradsync: rank %d: aborting the MPI job (exit status 1) because gradsync stopped with: %s",
              runtime.rank, failure)
    for stream in (sys.stdout, sys.stderr):  # MPI_Abort ends the process without flushing them
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken: nothing more to save
            pass
    if os.environ.get("OMPI_MCA_mpi_ft_enable", "").lower() in ("1", "true", "yes"):
        # Open MPI with ULFM (`mpiexec --with-ft ulfm`): after a process failure, survivors calling
        # MPI_Abort left the launcher running with every process gone in 4 of 8 runs here, while a
        # non-zero exit ends the job at once (8 of 8): its launcher ends the job on one.
        os._exit(1)
    from mpi4py import MPI

    # COMM_WORLD, not gradsync's communicator: MPICH's MPI_Abort on any other communicator ends only
    # the calling process, and a launcher that does not clean up would then keep the job running.
    MPI.COMM_WORLD.Abort(1)
    os._exit(1)  # MPI_Abort does not return; should an MPI let it, still end here


def get() -> Runtime:
    """The runtime of this process.

    Raises:
        NotInitializedError: ``init()`` was not called (or ``shutdown()`` was).
        GradsyncError: this process was forked from an initialised one (a DataLoader worker, say).
    """
    runtime = _runtime
    if runtime is None:
        if _was_shut_down:
            raise NotInitializedError(
                "gradsync is not initialised: gradsync.shutdown() was called (or the interpreter "
                "is exiting); call gradsync.init() first (a torch.distributed group on the "
                "gradsync backend: dist.destroy_process_group() before shutdown())")
        raise NotInitializedError("gradsync is not initialised: call gradsync.init() first")
    if runtime.forked:  # (a flag set at fork: os.getpid() is a system call, and every op asks)
        raise GradsyncError(
            f"gradsync: process {os.getpid()} was forked from rank {runtime.rank} (pid "
            f"{runtime.pid}) after gradsync.init(); a forked child (such as a DataLoader worker) "
            "cannot run collectives: call gradsync only from the main process")
    return runtime


def is_initialized() -> bool:
    """True between ``init()`` and ``shutdown()`` in this process."""
    return _runtime is not None and not _runtime.forked


def _forked() -> None:
    """In the child of ``os.fork()`` (multiprocessing, a DataLoader worker): the runtime, if any,
    is the parent's (:attr:`Runtime.forked`)."""
    if _runtime is not None:
        _runtime.forked = True


os.register_at_fork(after_in_child=_forked)


def rank() -> int:
    """This process's rank in the world, 0 .. size()-1. Raises NotInitializedError before init()."""
    return get().rank


def size() -> int:
    """Number of processes in the world (world size). Raises NotInitializedError before init()."""
    return get().size


def local_rank() -> int:
    """Rank among the processes on this host (shared-memory node), 0 .. local_size()-1: use it to
    pick the GPU (``torch.cuda.set_device(gradsync.local_rank())``). Raises NotInitializedError
    before init()."""
    return get().local_rank


def local_size() -> int:
    """Number of processes on this host. Raises NotInitializedError before init()."""
    return get().local_size


def cross_rank() -> int:
    """Rank of this host among the hosts: the rank among the processes of the same local_rank(),
    0 .. cross_size()-1. Raises NotInitializedError before init()."""
    return get().cross_rank


def cross_size() -> int:
    """Number of hosts (processes with the same local_rank across the job). Raises
    NotInitializedError before init()."""
    return get().cross_size
