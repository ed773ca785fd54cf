"""Process sets: collectives over a subset of the ranks.

A :class:`ProcessSet` names some world ranks. Once registered with :func:`add_process_set` (or
``init(process_sets=...)``) it gets its own duplicated communicator and its own coordinator thread on
each member rank, so collectives on it are negotiated among its members only: ops on disjoint sets
proceed at the same time, and a set never waits for a rank outside it. The global process set (id 0,
every rank) is the default ``process_set`` of every op.

Ranks are world ranks everywhere in the API (members, ``root_rank``); ``ProcessSet.rank()`` gives
this process's position inside the set, e.g. to pick its shard of the data. Same semantics as
Horovod's process sets, with registration collective over every rank, as Horovod's dynamic sets.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from .process import runtime


class ProcessSet:
    """Some world ranks, a unit on which collectives run.

    ``ProcessSet([0, 2])`` only describes the set; pass it to :func:`add_process_set` (on every rank)
    before using it. ``process_set_id`` is None until then, and again after
    :func:`remove_process_set`.

    Args:
        ranks: distinct world ranks, in any order (kept sorted); at least one.

    Raises:
        TypeError: a rank that is not an integer. ValueError: no ranks, negative or repeated ranks.
    """

    def __init__(self, ranks: Iterable[int]) -> None:
        ranks = list(ranks)
        bad = [r for r in ranks if not isinstance(r, (int, np.integer)) or isinstance(r, bool)]
        if bad:
            raise TypeError(f"gradsync: ProcessSet ranks must be integers, got {bad[0]!r}")
        ranks = sorted(int(r) for r in ranks)
        if not ranks:
            raise ValueError("gradsync: a ProcessSet needs at least one rank")
        repeated = sorted({r for r in ranks if ranks.count(r) > 1})
        if repeated or ranks[0] < 0:
            raise ValueError(f"gradsync: ProcessSet ranks must be distinct and >= 0, got {ranks}")
        self.ranks: list[int] = ranks
        self.process_set_id: int | None = None

    def size(self) -> int:
        """Number of ranks in the set."""
        return len(self.ranks)

    def included(self) -> bool:
        """True if this process (its world rank) is a member.

        Raises:
            NotInitializedError: before ``init()``.
        """
        return runtime.get().rank in self.ranks

    def rank(self) -> int:
        """This process's rank inside the set: its position in the sorted ``ranks``.

        Raises:
            ValueError: this process is not a member. NotInitializedError: before ``init()``.
        """
        world_rank = runtime.get().rank
        if world_rank not in self.ranks:
            raise ValueError(f"gradsync: rank {world_rank} is not in {self}")
        return self.ranks.index(world_rank)

    def __repr__(self) -> str:
        ident = "unregistered" if self.process_set_id is None else f"id {self.process_set_id}"
        return f"ProcessSet({ident}, ranks {self.ranks})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ProcessSet) and other.ranks == self.ranks

    def __hash__(self) -> int:
        return hash(tuple(self.ranks))


class _GlobalProcessSet(ProcessSet):
    """Every rank of the job; its ranks are known once gradsync is initialised."""

    def __init__(self) -> None:
        self.process_set_id = 0

    @property
    def ranks(self) -> list[int]:  # type: ignore[override]
        return list(range(runtime.get().size))

    def __repr__(self) -> str:
        return "ProcessSet(id 0, global: every rank)"


global_process_set: ProcessSet = _GlobalProcessSet()
"""The process set of every rank (id 0); the default of every op's ``process_set``."""


def add_process_set(process_set: ProcessSet | Iterable[int]) -> ProcessSet:
    """Register a process set: give it an id, a communicator and a coordinator on its members.

    Collective over every rank of the job (not only the members): every rank must call it with the
    same ranks, in the same order relative to other add/remove calls. Cheap enough to call during
    training, but it is not meant to run every step.

    Args:
        process_set: a :class:`ProcessSet`, or the world ranks of one.

    Returns:
        The registered set (the same object if one was passed), with ``process_set_id`` set.

    Raises:
        ValueError: a rank outside 0 .. size()-1; another set with these ranks is already registered
            (the global set excepted: a set of every rank is registered as a set of its own);
            the object is already registered; ranks that differ between ranks of the job (the message
            lists each rank's value).
        NotInitializedError: before ``init()``.
    """
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    return runtime.get().add_process_set(process_set)


def remove_process_set(process_set: ProcessSet) -> None:
    """Unregister ``process_set``: stop its coordinator and free its communicator.

    Collective over every rank of the job, like :func:`add_process_set`. Collectives still pending
    on the set fail with ShutdownError; later ones on it raise ValueError. The global set cannot be
    removed.

    Raises:
        ValueError: the global set, or a set that is not registered. NotInitializedError: before ``init()``.
    """
    runtime.get().remove_process_set(process_set)
