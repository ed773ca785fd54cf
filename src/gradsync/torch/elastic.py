"""``hvd.elastic`` at a fixed number of ranks: Horovod's elastic API without the resizing.

Horovod's elastic scripts (``examples/elastic/pytorch/``) wrap their training loop in
``@hvd.elastic.run``, keep the model, optimizer, sampler and counters in a ``hvd.elastic.TorchState``,
``commit()`` it now and then and draw batches from a ``hvd.elastic.ElasticSampler``. This module
gives those names Horovod 0.28.1's semantics for a job whose ranks do not change, which is also what
Horovod does when such a script is started by ``mpirun`` rather than ``horovodrun --min-np``:
``run`` synchronises the state from rank 0 and calls the function once; ``commit()`` saves the state
in this process's memory; ``restore()`` goes back to the last commit.

What it cannot do: resize the job. gradsync has no elastic driver (``horovodrun``'s host discovery
and rendezvous), and an MPI job cannot replace a lost rank, so no host update ever arrives
(``HostsUpdatedInterrupt`` is never raised) and a failed collective is not retried: the
``GradsyncError`` (``RankFailureError`` for a lost rank) leaves ``run`` with a note saying so.
Restart such a job from a checkpoint instead (docs/migrating-from-horovod.md, "elastic").
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import random
from collections.abc import Callable
from typing import Any

import torch

from ..errors import GradsyncError
from .basics import rank, size
from .functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters

__all__ = ["run", "TorchState", "ElasticSampler"]
log = logging.getLogger("gradsync")

NO_RECOVERY = ("gradsync.torch.elastic runs at a fixed number of ranks and does not recover from a "
               "failed collective or a lost rank (no elastic driver under mpiexec/srun): restart the "
               "job from a checkpoint")


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate the training function of an elastic script, as ``horovod.torch.elastic.run``.

    The wrapped function is called as ``func(state, *args, **kwargs)``: first ``state.sync()``
    (every rank takes rank 0's committed state: model parameters, optimizer state, sampler position,
    plain attributes), then ``func`` once, and its return value is returned. Every rank must call it.

    Raises:
        GradsyncError: what ``func`` or the sync raised (``RankFailureError`` for a lost rank), with
            a note that it is not recovered (logged as an error on Python 3.10); Horovod's elastic
            mode would restore the last commit and retry on the remaining hosts, which needs
            ``horovodrun``'s driver.
    """
    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        try:
            state.sync()
            return func(state, *args, **kwargs)
        except GradsyncError as error:
            if hasattr(error, "add_note"):  # Python >= 3.11
                error.add_note(NO_RECOVERY)
            else:
                log.error(NO_RECOVERY)
            raise
    return wrapper


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
        """Save the state (``save()``), then check for host updates, as Horovod's ``commit``.

        No host update can arrive under mpiexec or srun, so the check is nothing (on every rank, so
        no rank waits in a collective that another skips) and ``HostsUpdatedInterrupt`` is never
        raised.
        """
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Nothing to check: the ranks of a gradsync job are fixed."""

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
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)

    def sync(self) -> None:
        self._sync(self.value)


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
