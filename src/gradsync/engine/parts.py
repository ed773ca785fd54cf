"""What a coordinator hands its helpers, grouped: where its process set is, and what its cycle uses.

A :class:`~gradsync.engine.coordinator.Coordinator` builds both once and gives them to the objects
that run parts of its cycle (:class:`~gradsync.engine.execution.ResponseExecution`,
:class:`~gradsync.engine.caller_runs.CallerRuns`), instead of a dozen separate arguments. Both are
frozen: the references never change (the objects they name do, on the thread that holds the
coordinator's lock).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..executors import Executor
    from ..executors.device import DeviceExecutor
    from .negotiation import Negotiator
    from .request_queue import Entry, TensorQueue


@dataclasses.dataclass(frozen=True)
class SetPlace:
    """This rank's place in a coordinator's process set.

    Attributes:
        comm: the set's communicator (the coordinator's own).
        rank, size: this rank's rank in the set, and the set's size.
        world_ranks: for a process set other than the global one, ``world_ranks[i]`` is the world
            rank of the set's rank ``i`` (messages name world ranks); None for the global set.
        process_set_id: the set's id (0: the global set).
    """

    comm: Any
    rank: int
    size: int
    world_ranks: list[int] | None = None
    process_set_id: int = 0

    @classmethod
    def of(cls, comm: Any, world_ranks: list[int] | None = None, process_set_id: int = 0) -> SetPlace:
        """The place of this rank in ``comm``'s set."""
        return cls(comm, comm.Get_rank(), comm.Get_size(), world_ranks, process_set_id)

    def world(self, rank: int) -> int:
        """The world rank of the set's ``rank``."""
        return rank if self.world_ranks is None else self.world_ranks[rank]

    @property
    def world_rank(self) -> int:
        """This rank's world rank."""
        return self.world(self.rank)

    def note(self) -> str:
        """For a process set: which set a message is about (its ranks are world ranks); "" for the
        global set."""
        if self.world_ranks is None:
            return ""
        return f" (in process set {self.process_set_id}, world ranks {list(self.world_ranks)})"


@dataclasses.dataclass(frozen=True)
class CycleParts:
    """The collaborators a coordinator's cycle works with, shared with its helpers.

    Attributes:
        pending: the entries by name, submitted and not yet answered (the cycle fills it, the
            execution empties it).
        queue: where entries arrive; whether gradsync stopped.
        negotiator: this set's negotiation (told of every completed request).
        host, device: the executors of host and device memory.
    """

    pending: dict[str, Entry]
    queue: TensorQueue
    negotiator: Negotiator
    host: Executor
    device: DeviceExecutor
