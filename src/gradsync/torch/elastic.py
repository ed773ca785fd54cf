"""``hvd.elastic``: Horovod's elastic API, resized by restarts under ``gradsync.run``.

Horovod's elastic scripts (``examples/elastic/pytorch/``) wrap their training loop in
``@hvd.elastic.run``, keep the model, optimizer, sampler and counters in a ``hvd.elastic.TorchState``,
``commit()`` it now and then and draw batches from a ``hvd.elastic.ElasticSampler``. This module
gives those names Horovod 0.28.1's semantics, with one difference in how a job changes size: an MPI
job cannot replace a lost rank or add one, so the elastic driver (``python -m gradsync.run``,
docs/elastic.md) *restarts* the job through mpiexec on the hosts available, and the restarted
workers resume from the last commit, which rank 0 wrote to the driver's state directory
(``GRADSYNC_ELASTIC_STATE_DIR``). What is lost on a failure is what came after the last commit.

* ``commit()`` saves the state in memory and, under the driver, writes it to the state directory
  (rank 0, atomically), then checks for added hosts: when the driver signalled some, every rank
  raises ``HostsUpdatedInterrupt`` at that same commit, and ``run`` ends the workers with status
  ``EXIT_HOSTS_UPDATED`` so the driver relaunches them at the new size.
* ``run`` loads the committed state (when the state directory has one) on rank 0, syncs it to every
  rank and runs the reset callbacks (so a learning rate scaled by ``size()`` follows the new size),
  then calls the function. A ``GradsyncError`` or other exception is recorded for the driver's log
  and re-raised: the job ends and the driver relaunches it.

Without the driver (plain ``mpiexec``) nothing is written, no host update ever arrives and a failure
ends the job, which is what Horovod does when such a script is started by ``mpirun``.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import random
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..errors import GradsyncError, RankFailureError
from ..run import store
from .basics import rank, size
from .functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters

__all__ = ["run", "TorchState", "ElasticSampler", "HostsUpdatedInterrupt"]
log = logging.getLogger("gradsync")

NO_RECOVERY = ("gradsync.torch.elastic started without the elastic driver does not recover from a "
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
        try:
            state.resume(directory)
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

    Subclasses define ``save`` (copy to this process's memory), ``restore`` (back to the copy) and
    ``sync`` (every rank takes rank 0's copy; a collective).
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
            store.write_atomically(directory / store.COMMITTED, lambda path: torch.save(committed, path))
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Under the driver, rank 0 looks for its host-update flag and broadcasts what it found, so
        every rank raises ``HostsUpdatedInterrupt`` at the same commit; else nothing (on every rank)."""
        directory = store.state_dir()
        if directory is None:
            return
        updated = rank() == 0 and (directory / store.HOSTS_UPDATED).exists()
        if broadcast_object(updated, root_rank=0):
            raise HostsUpdatedInterrupt()

    def resume(self, directory: Path | None) -> None:
        """Make the state the same on every rank before training: from the last commit in
        ``directory`` when there is one (then the reset callbacks run), else rank 0's. A collective."""
        path = directory / store.COMMITTED if directory is not None else None
        found = directory is not None and broadcast_object(rank() == 0 and path.exists(), root_rank=0)
        if found and rank() == 0:
            self.load_committed(torch.load(path, weights_only=False))
        self.sync()
        if found:
            self.save()
            self.on_reset()

    def committed(self) -> Any:
        """What ``commit()`` writes for a restart (picklable by ``torch.save``)."""
        raise NotImplementedError

    def load_committed(self, committed: Any) -> None:
        """Take the state that ``committed()`` returned in an earlier launch."""
        raise NotImplementedError

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """Called by ``on_reset`` before the callbacks; nothing by default."""


class _Handler:
    """Saves, restores and syncs one state_dict-bearing object (model, optimizer, sampler)."""

    def __init__(self, value: Any, sync: Callable[[Any], None]):
        self.value = value
        self._sync = sync
        self.save()

    def save(self) -> None:
        self.saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self.saved)

    def sync(self) -> None:
        self._sync(self.value)


def _entry(saved: dict[str, Any], name: str) -> Any:
    if name not in saved:
        raise KeyError(f"the committed elastic state has no {name!r} (it has {sorted(saved)}): was it "
                       "written by another version of the training script?")
    return saved[name]


def _sync_model(model: torch.nn.Module) -> None:
    broadcast_parameters(model.state_dict(), root_rank=0)


def _sync_optimizer(optimizer: torch.optim.Optimizer) -> None:
    broadcast_optimizer_state(optimizer, root_rank=0)


def _sync_sampler(sampler: ElasticSampler) -> None:
    sampler.load_state_dict(broadcast_object(sampler.state_dict(), root_rank=0))


def _handler_for(value: Any) -> _Handler | None:
    """The handler of a model, optimizer or ElasticSampler; None for a plain attribute."""
    for kind, sync in ((torch.nn.Module, _sync_model), (torch.optim.Optimizer, _sync_optimizer),
                       (ElasticSampler, _sync_sampler)):
        if isinstance(value, kind):
            return _Handler(value, sync)
    return None


class TorchState(State):
    """The state of a PyTorch training process, as ``horovod.torch.elastic.TorchState``.

    Every keyword argument becomes an attribute. Models (``torch.nn.Module``), optimizers and
    ``ElasticSampler``s are saved through their ``state_dict()`` (deep copies in host memory of
    this process) and synced with ``broadcast_parameters``, ``broadcast_optimizer_state`` and
    ``broadcast_object``; any other value (epoch, batch, lists) is saved as it is and synced with
    ``broadcast_object`` (so it must pickle). ``sync`` gives every rank rank 0's *committed* plain
    attributes, as Horovod's. Assigning a new model, optimizer or sampler to its attribute saves it.

    Args:
        model: a ``torch.nn.Module``, or None.
        optimizer: a ``torch.optim.Optimizer`` (a ``DistributedOptimizer`` too), or None.
        kwargs: further attributes.
    """

    def __init__(self, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, **kwargs: Any):
        kwargs.update(model=model, optimizer=optimizer)
        handlers = {name: _handler_for(value) for name, value in kwargs.items()}
        object.__setattr__(self, "_handlers", {n: h for n, h in handlers.items() if h is not None})
        object.__setattr__(self, "_saved", {n: v for n, v in kwargs.items() if handlers[n] is None})
        super().__init__()
        for name, value in kwargs.items():
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._handlers:
            self._handlers[name] = _handler_for(value) or _Handler(value, self._handlers[name]._sync)
        super().__setattr__(name, value)

    def save(self) -> None:
        """Copy the models', optimizers' and samplers' state_dicts and the plain attributes."""
        for handler in self._handlers.values():
            handler.save()
        self._saved = {name: getattr(self, name) for name in self._saved}

    def restore(self) -> None:
        """Load the last saved state back (uncommitted changes are lost)."""
        for handler in self._handlers.values():
            handler.restore()
        for name, value in self._saved.items():
            object.__setattr__(self, name, value)

    def committed(self) -> dict[str, dict[str, Any]]:
        """The last saved state: ``{"handlers": name -> state_dict, "attrs": name -> value}``."""
        return {"handlers": {name: handler.saved for name, handler in self._handlers.items()},
                "attrs": dict(self._saved)}

    def load_committed(self, committed: dict[str, dict[str, Any]]) -> None:
        """Load ``committed()``'s output into the models, optimizers, samplers and attributes.

        Raises:
            KeyError: the commit lacks one of this state's attributes (the script changed).
        """
        for name, handler in self._handlers.items():
            handler.value.load_state_dict(_entry(committed["handlers"], name))
        for name in self._saved:
            object.__setattr__(self, name, _entry(committed["attrs"], name))
        self._saved = {name: getattr(self, name) for name in self._saved}

    def sync(self) -> None:
        """Every rank takes rank 0's state: a collective that every rank must call."""
        for handler in self._handlers.values():
            handler.sync()
        if self._saved:
            self._saved = broadcast_object(self._saved, root_rank=0)
            for name, value in self._saved.items():
                object.__setattr__(self, name, value)


class ElasticSampler(torch.utils.data.Sampler):
    """Partitions a dataset across ranks and skips the samples already processed this epoch.

    Horovod's ``horovod.torch.elastic.ElasticSampler``: like ``DistributedSampler`` (every rank
    gets ``ceil(remaining / size)`` indices, padded with the first ones, rank r taking every
    size-th from r), shuffled with ``random.Random(seed + epoch)`` when ``shuffle``, and it
    remembers how many samples all ranks together processed (``record_batch``), so that a state
    synced or restored mid-epoch resumes after them. Call ``set_epoch`` at the end of each epoch.
    Needs ``init()`` first (it reads ``rank()`` and ``size()``).

    Args:
        dataset: a dataset of constant length.
        shuffle: shuffle the indices (the same order on every rank).
        seed: the shuffle's seed, the same on every rank.
    """

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: a new order when shuffling, and no samples processed yet."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Count one batch of ``batch_size`` samples on every rank as processed."""
        self.processed_num += batch_size * self.num_replicas

    def state_dict(self) -> dict[str, int]:
        """``{"epoch": ..., "processed_num": ...}``."""
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Take the epoch and the processed count of ``state_dict`` and repartition."""
        self.epoch = state_dict["epoch"]
        self.processed_num = state_dict["processed_num"]
        self.reset()

    def reset(self) -> None:
        """Repartition the epoch's unprocessed indices among the current ranks."""
        self.num_replicas = size()
        self.rank = rank()
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        self.remaining_indices = order[self.processed_num:]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self):
        remaining = self.remaining_indices
        padded = remaining + remaining[:self.total_size - len(remaining)]
        return iter(padded[self.rank:self.total_size:self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples
