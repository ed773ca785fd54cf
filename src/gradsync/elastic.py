"""Horovod's elastic API without a framework: ``run``, ``State`` and ``HostsUpdatedInterrupt``.

An MPI job cannot replace a lost rank or add one, so the elastic driver (``python -m gradsync.run``,
docs/elastic.md) *restarts* the job on the hosts available, and the restarted workers resume from
the last commit, which rank 0 wrote to the driver's state directory (``GRADSYNC_ELASTIC_STATE_DIR``,
:mod:`gradsync.run.store`). What is lost on a failure is what came after the last commit.

* ``State.commit()`` saves the state in memory and, under the driver, writes it to the state
  directory (rank 0, atomically), then checks for added hosts: when the driver signalled some, every
  rank raises ``HostsUpdatedInterrupt`` at that same commit, and ``run`` ends the workers with status
  ``EXIT_HOSTS_UPDATED`` so the driver relaunches them at the new size.
* ``run`` loads the committed state (when the state directory has one) on rank 0, syncs it to every
  rank and runs the reset callbacks (so a learning rate scaled by ``size()`` follows the new size),
  then calls the function. An exception is recorded for the driver's log and the MPI job aborted:
  the driver relaunches it.

The framework adapters subclass ``State``: ``gradsync.torch.elastic.TorchState`` (models, optimizers,
samplers; the commit written with ``torch.save``) and ``gradsync.jax.elastic.JaxState`` (pytrees;
the commit pickled with numpy leaves). This module imports no deep-learning framework.

Without the driver (plain ``mpiexec``) nothing is written, no host update ever arrives and a failure
ends the job, which is what Horovod does when such a script is started by ``mpirun``.
"""

from __future__ import annotations

import copy
import functools
import logging
import pickle
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .errors import GradsyncError, RankFailureError
from .ops import broadcast_object
from .process import runtime
from .process.runtime import rank
from .run import store

__all__ = ["run", "State", "AttributesState", "HostsUpdatedInterrupt"]
log = logging.getLogger("gradsync")

NO_RECOVERY = ("gradsync elastic state started without the elastic driver does not recover from a "
               "failed collective or a lost rank: start the job with `python -m gradsync.run` "
               "(docs/elastic.md) to relaunch it from the last commit")
RELAUNCH = "the elastic driver relaunches the job from the last commit (docs/elastic.md)"


class HostsUpdatedInterrupt(RuntimeError):
    """Raised by ``commit()`` on every rank when the elastic driver added hosts (Horovod's name).

    ``run`` turns it into an exit with status ``EXIT_HOSTS_UPDATED`` after the commit was written;
    the driver then relaunches the job at the new size.
    """

    def __init__(self, skip_sync: bool = False):
        super().__init__("hosts were added: stopping at this commit to restart at the new size")
        self.skip_sync = skip_sync


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate the training function of an elastic script, as ``horovod.torch.elastic.run``.

    The wrapped function is called as ``func(state, *args, **kwargs)`` after the state is made the
    same on every rank: under the elastic driver with a commit in its state directory, rank 0 loads
    it, every rank takes it (``state.sync()``) and the reset callbacks run; otherwise every rank takes
    rank 0's state (``state.sync()``). Its return value is returned. Every rank must call it.

    Raises:
        SystemExit: status ``EXIT_HOSTS_UPDATED`` when ``commit()`` raised ``HostsUpdatedInterrupt``.
            Under the driver, any other exception is printed and the MPI job aborted (``MPI_Abort``,
            status 1), so that the driver relaunches it at once.
        GradsyncError: what ``func`` or the sync raised (``RankFailureError`` for a lost rank), with
            a note saying what happens next; under the driver, any exception is also recorded in
            the state directory so that the driver's log names it.
    """
    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        directory = store.state_dir()
        _record_start(directory)
        try:
            state.resume(directory)
            _record_time(directory, "resume_end")
            return func(state, *args, **kwargs)
        except HostsUpdatedInterrupt:
            if directory is None:
                raise
            log.info("gradsync: rank %d: hosts were added; exiting to restart at the new size", rank())
            raise SystemExit(store.EXIT_HOSTS_UPDATED) from None
        except Exception as error:
            _note_failure(error, directory)
            if directory is not None:
                _abort_job()
            raise
    return wrapper


_first_commit_recorded = False


def _record_time(directory: Path | None, event: str, when: float | None = None,
                 cpu: float | None = None) -> None:
    """Under the driver, rank 0 notes when this launch passed ``event`` (:func:`store.record_time`):
    now, or ``when`` with ``cpu``, this process's CPU seconds then."""
    if directory is not None and rank() == 0:
        if when is None:
            when, cpu = time.time(), time.process_time()
        store.record_time(directory, event, store.restart_count(), when, cpu)


def _record_start(directory: Path | None) -> None:
    """Note the start of this process, of ``gradsync.init()`` and its end, and of the resume."""
    started = store.process_start_time()
    if started is not None:
        _record_time(directory, "process_start", started, 0.0)
    for event, (when, cpu) in zip(("init_start", "init_end"), getattr(runtime.get(), "init_times", ())):
        _record_time(directory, event, when, cpu)
    _record_time(directory, "resume_start")


def _abort_job() -> None:
    """Under the driver: print the exception and end the MPI job now (``MPI_Abort``), so the driver
    relaunches at once instead of after the other ranks' shutdown timeout."""
    traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    from mpi4py import MPI

    MPI.COMM_WORLD.Abort(1)


def _note_failure(error: Exception, directory: Path | None) -> None:
    """Record ``error`` for the driver (under it) and add a note saying what happens next."""
    if directory is not None and not isinstance(error, RankFailureError):
        store.record_failure(directory, rank(), error)  # a survivor's report names no failed host
    if isinstance(error, GradsyncError):
        note = RELAUNCH if directory is not None else NO_RECOVERY
        if hasattr(error, "add_note"):  # Python >= 3.11
            error.add_note(note)
        else:
            log.error(note)


class State:
    """What an elastic script keeps across resets: Horovod's ``horovod.common.elastic.State``.

    Subclasses define ``save`` (copy to this process's memory), ``restore`` (back to the copy),
    ``sync`` (every rank takes rank 0's copy; a collective), ``committed``/``load_committed`` (the
    copy as a picklable object, and back), and may replace ``write_commit``/``read_commit`` (how
    that object is stored: ``pickle`` here).
    """

    def __init__(self) -> None:
        self._reset_callbacks: list[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Keep ``callbacks`` to call after a reset; at a fixed number of ranks none happens."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Run ``reset()`` and the registered callbacks (Horovod calls this after a host change)."""
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state (``save()``), write it for a restart, then check for host updates.

        Under the elastic driver rank 0 writes the saved state to ``committed.pt`` in the state
        directory (a temporary file, then ``os.replace``: a restart finds this commit or the one
        before, whole). Without the driver nothing is written and the check is nothing.

        Raises:
            HostsUpdatedInterrupt: on every rank, when the driver signalled added hosts.
        """
        self.save()
        directory = store.state_dir()
        if directory is not None and rank() == 0:
            committed = self.committed()
            store.write_atomically(directory / store.COMMITTED,
                                   lambda path: self.write_commit(committed, path))
        self.check_host_updates()
        global _first_commit_recorded
        if directory is not None and not _first_commit_recorded:  # this launch's first, for its timing
            _first_commit_recorded = True
            _record_time(directory, "first_commit")

    def check_host_updates(self) -> None:
        """Under the driver, rank 0 looks for its host-update flag and broadcasts what it found, so
        every rank raises ``HostsUpdatedInterrupt`` at the same commit; else nothing (on every rank)."""
        directory = store.state_dir()
        if directory is None:
            return
        updated = rank() == 0 and (directory / store.HOSTS_UPDATED).exists()
        if broadcast_object(updated, root_rank=0, name="elastic.hosts_updated"):
            raise HostsUpdatedInterrupt()

    def resume(self, directory: Path | None) -> None:
        """Make the state the same on every rank before training: from the last commit in
        ``directory`` when there is one (then the reset callbacks run), else rank 0's. A collective."""
        path = directory / store.COMMITTED if directory is not None else None
        found = directory is not None and broadcast_object(rank() == 0 and path.exists(), root_rank=0,
                                                           name="elastic.found")
        if found and rank() == 0:
            self.load_committed(self.read_commit(path))
        self.sync()
        if found:
            self.save()
            self.on_reset()

    def write_commit(self, committed: Any, path: Path) -> None:
        """Store ``committed()``'s output in the file ``path`` (``pickle``)."""
        with open(path, "wb") as out:
            pickle.dump(committed, out, protocol=pickle.HIGHEST_PROTOCOL)

    def read_commit(self, path: Path) -> Any:
        """Read what ``write_commit`` stored in ``path``."""
        with open(path, "rb") as stored:
            return pickle.load(stored)

    def committed(self) -> Any:
        """What ``commit()`` writes for a restart (picklable)."""
        raise NotImplementedError

    def load_committed(self, committed: Any) -> None:
        """Take the state that ``committed()`` returned in an earlier launch."""
        raise NotImplementedError

    def save(self) -> None:
        """Copy the state to this process's memory."""
        raise NotImplementedError

    def restore(self) -> None:
        """Go back to the last saved copy."""
        raise NotImplementedError

    def sync(self) -> None:
        """Every rank takes rank 0's state (a collective)."""
        raise NotImplementedError

    def reset(self) -> None:
        """Called by ``on_reset`` before the callbacks; nothing by default."""


def entry(saved: dict[str, Any], name: str) -> Any:
    """``saved[name]``; a ``KeyError`` that says what the commit has when it lacks ``name``."""
    if name not in saved:
        raise KeyError(f"the committed elastic state has no {name!r} (it has {sorted(saved)}): was it "
                       "written by another version of the training script?")
    return saved[name]


class AttributesState(State):
    """A ``State`` whose further keyword arguments are plain attributes (``epoch``, ``batch``,
    lists, ...): kept as deep copies at ``save()``, given back at ``restore()``, committed as they
    are (they must pickle) and synced from rank 0's *saved* copy with ``broadcast_object``
    (Horovod's ``ObjectState``). Subclasses call :meth:`_set_attributes` once, and the
    ``*_attributes`` helpers from their own ``save``/``restore``/``sync``/``load_committed``.
    """

    def _set_attributes(self, attributes: dict[str, Any]) -> None:
        self._attrs = list(attributes)
        for name, value in attributes.items():
            setattr(self, name, value)
        self._saved: dict[str, Any] = {}

    def _save_attributes(self) -> None:
        self._saved = {name: copy.deepcopy(getattr(self, name)) for name in self._attrs}

    def _restore_attributes(self) -> None:
        for name, value in self._saved.items():
            setattr(self, name, copy.deepcopy(value))

    def _load_attributes(self, committed: dict[str, Any]) -> None:
        """Take the attributes of a commit; ``KeyError`` (via :func:`entry`) names a missing one."""
        for name in self._attrs:
            setattr(self, name, entry(committed, name))

    def _sync_attributes(self) -> None:
        """Every rank takes rank 0's saved attributes (a collective when there are any)."""
        if self._saved:
            self._saved = broadcast_object(self._saved, root_rank=0, name="elastic.attrs")
            self._restore_attributes()
