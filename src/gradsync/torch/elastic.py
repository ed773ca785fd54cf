"""``hvd.elastic``: Horovod's elastic API for PyTorch, resized by restarts under ``gradsync.run``.

Horovod's elastic scripts (``examples/elastic/pytorch/``) wrap their training loop in
``@hvd.elastic.run``, keep the model, optimizer, sampler and counters in a ``hvd.elastic.TorchState``,
``commit()`` it now and then and draw batches from a ``hvd.elastic.ElasticSampler``. This module
gives those names Horovod 0.28.1's semantics, with one difference in how a job changes size: an MPI
job cannot replace a lost rank or add one, so the elastic driver (``python -m gradsync.run``,
docs/elastic.md) *restarts* the job on the hosts available, and the restarted workers resume from
the last commit, which rank 0 wrote to the driver's state directory. ``run``, ``State`` and
``HostsUpdatedInterrupt`` are the framework-neutral ones of :mod:`gradsync.elastic` (what a commit,
a resume and a host update do); this module adds what is PyTorch's: ``TorchState`` (state_dicts,
the commit written with ``torch.save``) and ``ElasticSampler``.
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..elastic import HostsUpdatedInterrupt, State, entry, run
from .basics import rank, size
from .functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters

__all__ = ["run", "TorchState", "ElasticSampler", "HostsUpdatedInterrupt"]


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

    def write_commit(self, committed: dict[str, dict[str, Any]], path: Path) -> None:
        """``torch.save`` of ``committed()``'s output (tensors of any device) to ``path``."""
        torch.save(committed, path)

    def read_commit(self, path: Path) -> dict[str, dict[str, Any]]:
        """``torch.load`` of what ``write_commit`` stored (not ``weights_only``: plain attributes
        may be any picklable object)."""
        return torch.load(path, weights_only=False)

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
            handler.value.load_state_dict(entry(committed["handlers"], name))
        for name in self._saved:
            object.__setattr__(self, name, entry(committed["attrs"], name))
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
