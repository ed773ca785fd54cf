"""Rank 0's side of a full negotiation: the table of submitted requests, readiness, and the checks
that every rank agrees on a collective.

In a full negotiation (:mod:`gradsync.engine.negotiation`) every rank sends rank 0 the requests it
has not sent before; rank 0's :class:`MessageTable` records them by name (each rank's request)
and, once the last rank's request for a name has arrived, checks that the ranks agree on it
(:func:`_disagreement`: kind, dtype, op, root, scales, group, device, shape) and answers it: an
error naming each rank's value, or a response; ready allreduces are fused
(:mod:`gradsync.engine.fusion`). The members of a group are held until the whole group is ready
everywhere, then answered as one response. Ranks that called join() count as submitted (except
for join itself), and the stall inspector's reports are built here from what every rank waits for.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from . import fusion, joins
from .protocol import GROUP, CycleReply, Kind, RankMessage, Request, Response
from .stall_inspector import StallInspector

log = logging.getLogger("gradsync")

# Fields on which every rank must agree, with the word used in error messages.
_AGREED_FIELDS = (("kind", "collective"), ("dtype", "dtype"), ("op", "op"), ("root", "root rank"),
                  ("prescale", "prescale_factor"), ("postscale", "postscale_factor"),
                  ("group", "group"), ("group_size", "group size"), ("device", "device"))
# Collectives whose first dimension may differ between ranks.
_VARIABLE_FIRST_DIM = (Kind.ALLGATHER, Kind.ALLTOALL)


class MessageTable:
    """Rank 0's record of submitted requests not yet answered."""

    def __init__(self, size: int, fusion_threshold: int,
                 inspector: StallInspector | None = None,
                 world_ranks: tuple[int, ...] | None = None) -> None:
        """``world_ranks[i]``: the world rank of rank ``i`` (of a process set), so that messages name
        world ranks; None for the global set."""
        self.size = size
        self.world = tuple(world_ranks) if world_ranks is not None else tuple(range(size))
        self.fusion_threshold = fusion_threshold
        self.inspector = inspector
        self._requests: dict[str, list[Request | None]] = {}
        self._first_seen: dict[str, float] = {}
        self._held: dict[str, list[str]] = {}  # group -> its members ready so far, until all are
        self.joined: list[int] = []  # ranks that called join(), in the order they did
        self._elsewhere: dict[str, dict[int, int]] = {}  # name -> {rank: other process set id}

    def cycle(self, gathered: Iterable[RankMessage]) -> CycleReply:
        """Take one cycle's messages (one :class:`RankMessage` per rank, in rank order)."""
        ready: list[str] = []
        shutdown_ranks = []
        messages = list(gathered)
        now = time.monotonic()
        joined_before = list(self.joined)
        grouped = bool(self._held)
        for rank, message in enumerate(messages):
            if message.shutdown:
                shutdown_ranks.append(rank)
            grouped = grouped or any(map(GROUP, message.requests))
            for request in message.requests:
                slots = self._requests.get(request.name)
                if slots is None:
                    slots = self._requests[request.name] = [None] * self.size
                    self._first_seen[request.name] = now
                slots[rank] = request
                if request.kind == Kind.JOIN and rank not in self.joined:
                    self.joined.append(rank)
                if self._ready(slots):
                    ready.append(request.name)
        if self.joined != joined_before:  # a join may complete what waited only for that rank
            held = {name for members in self._held.values() for name in members}
            ready += [name for name, slots in self._requests.items()
                      if name not in ready and name not in held and self._ready(slots)]
            grouped = True  # what the join completed may hold group members
        responses = self._responses(self._ready_units(ready) if grouped else ready)
        stall_error = None
        if self.inspector is not None and any(m.stall for m in messages):
            stall_error = self._inspect(messages, now)
        joined = tuple(self.joined) if self.joined != joined_before else None
        return CycleReply(responses, tuple(shutdown_ranks), stall_error=stall_error, joined=joined)

    def _ready(self, slots: list[Request | None]) -> bool:
        """Every rank submitted it; ranks that joined count as submitted, except for join itself."""
        present = [slot is not None for slot in slots]
        if all(present):
            return True
        kind = next(slot.kind for slot in slots if slot is not None)
        return kind != Kind.JOIN and all(p or r in self.joined for r, p in enumerate(present))

    def _first(self, name: str) -> Request:
        return next(slot for slot in self._requests[name] if slot is not None)

    def _ready_units(self, ready: list[str]) -> list[str | tuple[str, ...]]:
        """``ready`` (names ready on every rank) with the members of each group held back until the
        whole group is ready, then given as one tuple of names. A group whose ranks disagree on
        its size is given at once, with every member anyone submitted, so that it fails as a whole.
        (Each rank's own :meth:`Negotiator._submitted_groups` offers a group only once it was
        wholly submitted there.)"""
        units: list[str | tuple[str, ...]] = []
        failed: set[str] = set()  # groups given whole already, because their ranks disagreed on size
        for name in ready:
            first = self._first(name)
            if first.group in failed:
                continue
            if not first.group:
                units.append(name)
                continue
            members = self._held.setdefault(first.group, [])
            members.append(name)
            sizes = {slot.group_size for slot in self._requests[name] if slot is not None}
            if len(sizes) > 1:
                units.append(tuple(n for n, slots in self._requests.items()
                                   if any(s is not None and s.group == first.group for s in slots)))
                del self._held[first.group]
                failed.add(first.group)
            elif len(members) == first.group_size:
                units.append(tuple(members))
                del self._held[first.group]
        return units

    def _inspect(self, messages: list[RankMessage], now: float) -> str | None:
        """Log the stall report; return it if every rank must shut down with it."""
        submitted: dict[str, set[int]] = {}
        ages: dict[str, float] = {}
        for name, slots in self._requests.items():
            if any(slot is not None and slot.kind == Kind.JOIN for slot in slots):
                continue  # join() waits for the other ranks by design
            submitted[name] = {r for r, slot in enumerate(slots) if slot is not None}
            ages[name] = now - self._first_seen[name]
        # Remembered between reports: the other set may have given up on its collective already.
        elsewhere = self._elsewhere
        for rank, message in enumerate(messages):
            for name, age, other_set in message.pending or ():
                if other_set is not None:  # pending on another process set of that rank
                    elsewhere.setdefault(name, {})[rank] = other_set
                    continue
                submitted.setdefault(name, set()).add(rank)
                ages[name] = max(ages.get(name, 0.0), age)
        for name in [n for n in elsewhere if n not in submitted]:
            del elsewhere[name]
        report, shut = self.inspector.inspect(submitted, ages, elsewhere)
        if report is not None:
            log.warning("gradsync: rank %d: %s", self.world[0], report)
        return report if shut else None

    def pending(self) -> dict[str, list[int]]:
        """Names still waiting, with the ranks that have submitted them."""
        return {name: [r for r, slot in enumerate(slots) if slot is not None]
                for name, slots in self._requests.items()}

    def _responses(self, ready: list[str | tuple[str, ...]]) -> tuple[Response, ...]:
        responses: list[Response] = []
        allreduces: list[Request] = []
        joined = set(self.joined)
        representative: dict[str, Request] = {}
        for name in ready:
            if isinstance(name, tuple):
                responses.append(self._group_response(name, representative))
                continue
            slots, first = self._take(name, representative)
            error = _disagreement(slots, self.world)
            if error is None and first.kind == Kind.BROADCAST and first.root in joined:
                error = (f"broadcast {name!r}: its root rank {self.world[first.root]} has called join() and "
                         "cannot broadcast")
            refused = joins.refusal(first, (name,), self.world, joined) if error is None else None
            if refused is not None:
                responses.append(refused)
            elif error is not None:
                responses.append(Response(first.kind, (name,), error=error))
            elif first.kind == Kind.ALLREDUCE:
                allreduces.append(first)
            elif first.kind == Kind.ALLGATHER:
                responses.append(Response(first.kind, (name,), first_dims=(_first_dims(slots),)))
            elif first.kind == Kind.ALLTOALL:  # a joined rank sends no rows
                matrix = tuple((0,) * self.size if slot is None else slot.splits for slot in slots)
                responses.append(Response(first.kind, (name,), split_matrix=matrix))
            elif first.kind == Kind.JOIN:
                responses.append(Response(first.kind, (name,), last_joined=self.joined[-1]))
                self.joined = []
                joined = set()
            else:
                responses.append(Response(first.kind, (name,)))
        responses.extend(fusion.plan_allreduce(allreduces, self.fusion_threshold))
        if joined:  # joined ranks need each request to stand in for it
            responses = [r._replace(requests=tuple(representative[n] for n in r.names))
                         for r in responses]
        return tuple(joins.counting_contributors(responses, self.size, joined))

    def _take(self, name: str, representative: dict[str, Request]) -> tuple[list[Request | None], Request]:
        """Remove ``name`` from the table, answered: its slots, and its first request (recorded in
        ``representative``, from which joined ranks build their stand-ins)."""
        slots = self._requests.pop(name)
        del self._first_seen[name]
        first = representative[name] = next(slot for slot in slots if slot is not None)
        return slots, first

    def _group_response(self, names: tuple[str, ...], representative: dict[str, Request]) -> Response:
        """One response for a whole group: every member fused, or an error for every member."""
        error = None
        first_dims = []
        for name in names:
            slots, first = self._take(name, representative)
            error = error or _disagreement(slots, self.world)
            first_dims.append(_first_dims(slots))
        if error is None and len(names) != first.group_size:
            error = f"its ranks submitted {len(names)} members in all"
        refused = joins.refusal(first, names, self.world, self.joined) if error is None else None
        if refused is not None:
            return refused
        if error is not None:
            kind = first.kind.name.lower()
            return Response(first.kind, names, error=f"grouped {kind} {first.group!r} fails as a whole: "
                                                     f"{error}")
        if first.kind == Kind.ALLGATHER:
            return Response(first.kind, names, first_dims=tuple(first_dims))
        return Response(first.kind, names)


def _first_dims(slots: list[Request | None]) -> tuple[int, ...]:
    """Each rank's first dimension (allgather); a rank that joined and did not submit gives 0 rows."""
    return tuple(0 if slot is None or not slot.shape else slot.shape[0] for slot in slots)


def _disagreement(slots: list[Request | None], world: tuple[int, ...]) -> str | None:
    """An error message if the ranks' requests for one name disagree, else None (ranks that
    joined and did not submit it are left out). ``world[i]`` is the world rank of slot ``i``: the
    message names world ranks, also as root ranks."""
    present = [(world[rank], r) for rank, r in enumerate(slots) if r is not None]
    first = present[0][1]
    signature = first.signature()
    if first.kind not in _VARIABLE_FIRST_DIM and all(r.signature() == signature for _, r in present):
        return None  # the common case: equal but for the rank
    kind = first.kind.name.lower()
    for field, word in _AGREED_FIELDS:
        values = [(rank, getattr(r, field)) for rank, r in present]
        if field == "root":
            values = [(rank, world[root]) for rank, root in values]
        if any(v != values[0][1] for _, v in values):
            return _mismatch(kind, first.name, word, values)
    shapes = [(rank, r.shape) for rank, r in present]
    if first.kind in _VARIABLE_FIRST_DIM:
        if any(len(s) == 0 for _, s in shapes) or any(s[1:] != shapes[0][1][1:] for _, s in shapes):
            return _mismatch(kind, first.name, "shape (all but the first dimension must match)",
                             shapes)
    elif any(s != shapes[0][1] for _, s in shapes):
        return _mismatch(kind, first.name, "shape", shapes)
    return None


def _mismatch(kind: str, name: str, word: str, values: list[tuple[int, object]]) -> str:
    listed = ", ".join(f"rank {rank}: {_show(v)}" for rank, v in values)
    hint = ""
    if ".noname." in name:
        hint = ("; unnamed collectives are matched by the order of the calls on each rank, so the "
                "ranks may have paired two different calls: pass name= to each")
    return f"{kind} {name!r}: ranks disagree on {word}: {listed}{hint}"


def _show(value) -> str:
    return value.name if hasattr(value, "name") and not isinstance(value, str) else repr(value)
