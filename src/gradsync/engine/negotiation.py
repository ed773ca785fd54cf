"""Negotiation: which requests are ready on every rank, and in what order every rank runs them.

*Full negotiation* (first sight of a collective): each rank sends rank 0 the requests it has not sent
before (``gather``). Rank 0 keeps a :class:`MessageTable` (tensor name -> each rank's request). When the
last rank's request for a name arrives, rank 0 checks that all ranks agree on it and emits a response;
ready allreduces are fused (:mod:`gradsync.engine.fusion`). Rank 0 broadcasts the ordered responses.

*Groups* (grouped_allreduce, grouped_reducescatter) are negotiated as one unit: a rank offers a
group only once every member was submitted locally, rank 0 answers it only once every member is
ready on every rank, and then with one response holding every member; a disagreement on any member
fails the whole group.

*Cached negotiation* (steady state, :mod:`gradsync.engine.response_cache`): a collective seen before is one
bit; one bitwise-AND allreduce of every rank's ready bits (plus flag bits) yields the cached collectives
ready everywhere. The full gather/broadcast runs only in cycles where some rank has an uncached request
or asks to shut down.

Either way every rank executes the same collectives in the same order, whatever order its own tensors
were produced in.
"""

from __future__ import annotations

import logging
import math
import operator
import time
from collections.abc import Callable, Iterable

import numpy as np
from mpi4py import MPI

from ..config import Config
from . import fusion, joins, waiting
from .protocol import CycleReply, Kind, RankMessage, Request, Response
from .response_cache import Lookup, ResponseCache, bits_from_list, bits_to_words, iter_bits, set_bits
from .stall_inspector import StallInspector

_UNCACHED_FLAG, _SHUTDOWN_FLAG, _STALL_FLAG = 1, 2, 4
_GROUP = operator.attrgetter("group")
log = logging.getLogger("gradsync")

# Fields on which every rank must agree, with the word used in error messages.
_AGREED_FIELDS = (("kind", "collective"), ("dtype", "dtype"), ("op", "op"), ("root", "root rank"),
                  ("prescale", "prescale_factor"), ("postscale", "postscale_factor"),
                  ("group", "group"), ("group_size", "group size"), ("device", "device"))
# Collectives whose first dimension may differ between ranks.
_VARIABLE_FIRST_DIM = (Kind.ALLGATHER, Kind.ALLTOALL)


class Parked(Exception):  # noqa: N818 - a control-flow signal, not an error
    """A cycle in a caller's turn stopped where it would block (:meth:`Negotiator.cycle`);
    ``resume(wait)`` runs the rest of it (``wait``: as :meth:`Negotiator.cycle`'s, None to block)
    and returns the cycle's reply, or raises Parked again."""

    def __init__(self, resume: Callable[[Callable | None], CycleReply]) -> None:
        super().__init__("a negotiation cycle parked in a caller's turn")
        self.resume = resume


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
            grouped = grouped or any(map(_GROUP, message.requests))
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


class Negotiator:
    """This rank's side of negotiation; used by the coordinator thread only (it owns ``comm``)."""

    def __init__(self, comm, config: Config, process_set_id: int = 0,
                 world_ranks: tuple[int, ...] | None = None) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.fusion_threshold = config.fusion_threshold
        self.cycle_time = config.cycle_time
        self.wait_policy = config.wait_policy
        self._proposal: tuple[int, float] | None = None  # rank 0: settings to send next cycle
        self.table = None
        if self.rank == 0:
            inspector = None
            if config.stall_check_time_seconds > 0:
                inspector = StallInspector(comm.Get_size(), config.stall_check_time_seconds,
                                           config.stall_shutdown_time_seconds, process_set_id,
                                           world_ranks)
            self.table = MessageTable(comm.Get_size(), config.fusion_threshold, inspector, world_ranks)
        self.cache = ResponseCache(config.cache_capacity) if config.cache_capacity > 0 else None
        self._words = math.ceil(config.cache_capacity / 64)
        self._all_ones = (1 << (64 * self._words)) - 1
        self._vector = np.empty(2 * self._words + 1, np.uint64)
        self._raw = memoryview(self._vector).cast("B")
        self._ones = bits_to_words(self._all_ones, self._words)  # no invalid bit
        self._ready_bits = 0  # cached requests ready on this rank, waiting for the others
        self._waiting: dict[int, Request] = {}  # bit -> this rank's request behind it
        self._resend: list[Request] = []  # requests whose bit was evicted: negotiate in full
        self.size = comm.Get_size()
        self.world = tuple(world_ranks) if world_ranks is not None else tuple(range(self.size))
        self.joined: frozenset[int] = frozenset()  # the same on every rank: changed by full replies
        self._partial: dict[str, list[Request]] = {}  # group -> members submitted here so far
        self.full_cycles = self.cached_cycles = 0

    def cycle(self, requests: list[Request], shutdown: bool, stall: bool = False,
              pending: Callable[[], tuple[tuple[str, float, int | None], ...]] = tuple,
              wait: Callable[[MPI.Request], None] | None = None) -> CycleReply:
        """Negotiate one cycle with every rank; returns the responses all ranks will execute, in order.

        ``stall``: this rank asks rank 0 for a stall report; ``pending()`` lists what this rank waits
        for (name, seconds waited, None) and what it waits for on its other process sets
        (name, 0.0, process set id), sent when a report is being made.

        ``wait``: in a caller's turn (:meth:`gradsync.engine.caller_runs.CallerRuns.waiter`), how
        to wait for the exchange's nonblocking allreduce, which may leave the turn. Then the cycle
        raises :class:`Parked` instead of blocking where it would: when ``wait`` leaves (the
        exchange still pending), and before a full negotiation (blocking gathers), whose rest the
        coordinator's next cycle resumes (:meth:`Parked.resume`, in any thread).

        Raises:
            Parked: only with ``wait`` (see above).
        """
        if self._partial or any(map(_GROUP, requests)):
            requests = self._submitted_groups(requests)
        if self.cache is None:
            message = RankMessage(shutdown, requests, stall, pending() if stall else None)
            if wait is not None:
                raise Parked(lambda wait: self._full_only(message))
            return self._full_only(message)
        uncached, invalid = self._offer(requests)
        has_uncached = bool(uncached) or self._proposal is not None
        # Nonblocking on every rank, whichever thread cycles: a nonblocking collective matches only
        # its nonblocking form on the other ranks (the background thread then waits as the
        # wait_policy says; MPICH measured the same either way, 3.9 us on 2 ranks).
        self._fill(invalid, has_uncached, shutdown, stall)
        return self._finish(self.comm.Iallreduce(MPI.IN_PLACE, self._vector, op=MPI.BAND),
                            uncached, shutdown, pending, wait)

    def _full_only(self, message: RankMessage) -> CycleReply:
        self.full_cycles += 1
        return self._full(message)

    def _finish(self, request: MPI.Request, uncached: list[Request], shutdown: bool,
                pending: Callable, wait: Callable[[MPI.Request], None] | None) -> CycleReply:
        """The rest of a cycle whose exchange is ``request`` (nonblocking): complete it (``wait``,
        else as the wait_policy says), then :meth:`_exchanged`."""
        try:
            if wait is not None:
                wait(request)
            elif self.wait_policy == "mpi":
                request.Wait()
            else:
                waiting.wait(request)
        except waiting.LeftTurn:
            raise Parked(lambda wait: self._finish(request, uncached, shutdown, pending, wait)) from None
        return self._exchanged(uncached, shutdown, pending, wait)

    def _exchanged(self, uncached: list[Request], shutdown: bool, pending: Callable,
                   wait: Callable | None) -> CycleReply:
        """After the exchange (the vector holds every rank's AND): the cached responses, and a full
        negotiation if any rank needs one (parked in a caller's turn: it blocks)."""
        ready, invalid, need_full, shutdown_any, stall_any = self._decode()
        for bit in iter_bits(invalid):
            self.forget(bit)
            self.cache.evict(bit)
        responses = self._cached_responses(ready)
        if not (need_full or shutdown_any or stall_any):
            self.cached_cycles += 1
            return CycleReply(tuple(responses))
        if wait is not None:
            raise Parked(lambda wait: self._full_after(responses, shutdown, uncached, stall_any, pending))
        return self._full_after(responses, shutdown, uncached, stall_any, pending)

    def _full_after(self, responses: list[Response], shutdown: bool, uncached: list[Request],
                    stall_any: bool, pending: Callable) -> CycleReply:
        self.full_cycles += 1
        # In a stall report every rank lists its pending collectives: cached ones are not in rank 0's table.
        reply = self._full(RankMessage(shutdown, uncached, stall_any, pending() if stall_any else None))
        return reply._replace(responses=tuple(responses) + reply.responses)

    def _offer(self, requests: list[Request]) -> tuple[list[Request], int]:
        """Set the ready bits of ``requests`` that hit the response cache (waiting for the other
        ranks from now on); return the rest, to negotiate in full (with any resent after an
        eviction), and the bits this rank found invalid."""
        uncached, self._resend = self._resend, []
        invalid = 0
        group_hits: list[tuple[Request, int]] = []
        hits: list[int] = []
        waiting, own = self._waiting, self.cache.own_bit
        for request in requests:
            bit = own(request)  # this rank's own request cached: the common case, without lookup()
            if bit < 0:
                state, bit = self.cache.lookup(request)
                if state is not Lookup.HIT:
                    if state is Lookup.INVALID:
                        invalid |= 1 << bit
                    uncached.append(request)
                    continue
            if request.group:
                group_hits.append((request, bit))
                continue
            hits.append(bit)
            waiting[bit] = request
        if hits:
            self._ready_bits |= bits_from_list(hits, self._words)
        if group_hits:  # a group is offered by its bits only if every member hit, else all in full
            partial = {request.group for request in uncached if request.group}
            for request, bit in group_hits:
                if request.group in partial:
                    uncached.append(request)
                else:
                    self._ready_bits |= 1 << bit
                    self._waiting[bit] = request
        return uncached, invalid

    def _submitted_groups(self, requests: list[Request]) -> list[Request]:
        """``requests`` minus the members of groups not yet wholly submitted on this rank (kept
        until their last member arrives, then given together)."""
        whole = []
        for request in requests:
            if not request.group:
                whole.append(request)
                continue
            members = self._partial.setdefault(request.group, [])
            members.append(request)
            if len(members) == request.group_size:
                whole.extend(self._partial.pop(request.group))
        return whole

    def propose(self, settings: tuple[int, float]) -> None:
        """Rank 0: make every rank use (fusion threshold, cycle time) after the next cycle."""
        self._proposal = settings

    def completed(self, request: Request) -> None:
        """``request``'s collective finished on every rank: cache it (all ranks do this in step)."""
        if self.cache is not None:
            evicted = self.cache.put(request)
            if evicted is not None:
                self.forget(evicted)

    def forget(self, bit: int) -> None:
        """``bit`` no longer names what this rank's waiting request meant: negotiate it in full."""
        request = self._waiting.pop(bit, None)
        if request is not None:
            self._ready_bits &= ~(1 << bit)
            self._resend.append(request)
            if request.group:  # a group waits whole or not at all
                for other in [b for b, r in self._waiting.items() if r.group == request.group]:
                    self.forget(other)

    def _fill(self, invalid: int, has_uncached: bool, shutdown: bool, stall: bool) -> None:
        """This rank's part of the exchange, an AND allreduce of the vector:
        [ready bits | inverted invalid bits | inverted flags]."""
        words = self._words
        # A joined rank stands in for every cached collective: the others alone decide what is ready.
        ready_bits = self._all_ones if self.rank in self.joined else self._ready_bits
        raw, half = self._raw, 8 * words  # the vector's bytes: ints in and out without numpy calls
        raw[:half] = bits_to_words(ready_bits, words)
        raw[half:2 * half] = bits_to_words(self._all_ones ^ invalid, words) if invalid else self._ones
        flags = ((_UNCACHED_FLAG if has_uncached else 0) | (_SHUTDOWN_FLAG if shutdown else 0)
                 | (_STALL_FLAG if stall else 0))
        raw[2 * half:] = (~flags & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little")

    def _decode(self) -> tuple[int, int, bool, bool, bool]:
        """The exchanged vector: (ready bits, invalid bits, need full, shutdown, stall)."""
        raw, half = self._raw, 8 * self._words
        ready = int.from_bytes(raw[:half], "little")
        kept = raw[half:2 * half]
        invalid_any = 0 if kept == self._ones else self._all_ones ^ int.from_bytes(kept, "little")
        common_flags = ~int.from_bytes(raw[2 * half:], "little")
        return (ready, invalid_any, bool(common_flags & _UNCACHED_FLAG),
                bool(common_flags & _SHUTDOWN_FLAG), bool(common_flags & _STALL_FLAG))

    def _cached_responses(self, ready: int) -> list[Response]:
        responses: list[Response] = []
        allreduces: list[Request] = []
        sizes: list[int] = []
        groups: dict[str, list[Request]] = {}
        take, joined, allreduce = self._waiting.pop, self.joined, Kind.ALLREDUCE
        bits = set_bits(ready)
        for bit, (cached, size) in zip(bits, self.cache.entries(bits)):
            # A joined rank has no request of its own: the cached one stands in for it.
            request = take(bit, None) or cached
            if request.group:  # every rank set a group's bits together, so all of them are here
                groups.setdefault(request.group, []).append(request)
            elif joined and (refused := joins.refusal(request, (request.name,), self.world, joined)):
                responses.append(refused)
            elif request.kind is allreduce:
                allreduces.append(request)
                sizes.append(size)
            else:
                responses.append(Response(request.kind, (request.name,), requests=(request,)))
        self._ready_bits &= ~ready
        for members in groups.values():
            names = tuple(r.name for r in members)
            responses.append(joins.refusal(members[0], names, self.world, joined)
                             or Response(members[0].kind, names, requests=tuple(members)))
        responses += fusion.plan_allreduce(allreduces, self.fusion_threshold, sizes,
                                           with_requests=True)
        return joins.counting_contributors(responses, self.size, joined)

    def _full(self, message: RankMessage) -> CycleReply:
        gathered = self.comm.gather(message, root=0)
        reply = None
        if self.rank == 0:
            reply = self.table.cycle(gathered)._replace(settings=self._proposal)
            self._proposal = None
        reply = self.comm.bcast(reply, root=0)
        if reply.joined is not None:
            self.joined = frozenset(reply.joined)
        if reply.settings is not None:  # applies from the next cycle on, on every rank alike
            self.fusion_threshold, self.cycle_time = reply.settings
            if self.table is not None:
                self.table.fusion_threshold = self.fusion_threshold
        return reply
