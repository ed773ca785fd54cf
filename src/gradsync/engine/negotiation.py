"""Negotiation: which requests are ready on every rank, and in what order every rank runs them.

*Full negotiation* (first sight of a collective): each rank sends rank 0 the requests it has not sent
before (``gather``). Rank 0 keeps a :class:`~gradsync.engine.message_table.MessageTable` (tensor
name -> each rank's request). When the last rank's request for a name arrives, rank 0 checks that
all ranks agree on it and emits a response; ready allreduces are fused
(:mod:`gradsync.engine.fusion`). Rank 0 broadcasts the ordered responses.

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

import math
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

from ..config import Config
from . import fusion, joins, waiting
from .message_table import MessageTable
from .protocol import GROUP, CycleReply, Kind, RankMessage, Request, Response
from .response_cache import Lookup, ResponseCache, bits_from_list, bits_to_words, iter_bits, set_bits
from .stall_inspector import StallInspector

_UNCACHED_FLAG, _SHUTDOWN_FLAG, _STALL_FLAG = 1, 2, 4


class Parked(Exception):  # noqa: N818 - a control-flow signal, not an error
    """A cycle in a caller's turn stopped where it would block (:meth:`Negotiator.cycle`);
    ``resume(wait)`` runs the rest of it (``wait``: as :meth:`Negotiator.cycle`'s, None to block)
    and returns the cycle's reply, or raises Parked again."""

    def __init__(self, resume: Callable[[Callable | None], CycleReply]) -> None:
        super().__init__("a negotiation cycle parked in a caller's turn")
        self.resume = resume


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
        self._exchange = _persistent_exchange(comm, self._vector) if self.cache is not None else None
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
        if self._partial or any(map(GROUP, requests)):
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
        # wait_policy says; MPICH measured the same either way, 3.9 us on 2 ranks). Persistent
        # where MPI has it (every rank runs the same MPI library, so the same form everywhere).
        self._fill(invalid, has_uncached, shutdown, stall)
        if self._exchange is not None:
            self._exchange.Start()
            request = self._exchange
        else:
            request = self.comm.Iallreduce(MPI.IN_PLACE, self._vector, op=MPI.BAND)
        return self._finish(request, uncached, shutdown, pending, wait)

    def close(self) -> None:
        """Free the persistent exchange (after a clean shutdown, before the communicator: no
        exchange is in flight then)."""
        if self._exchange is not None:
            self._exchange.Free()
            self._exchange = None

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
        if invalid:
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
        return joins.counting_contributors(responses, self.size, joined) if joined else responses

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


def _persistent_exchange(comm, vector: np.ndarray) -> MPI.Prequest | None:
    """The cached negotiation's exchange, an AND allreduce of ``vector`` in place, as a persistent
    collective (MPI-4's ``MPI_Allreduce_init``: set up once here, collectively, then started
    each cycle), or None where the MPI library has none (then each cycle calls
    ``MPI_Iallreduce``). Starting it skips the argument checks and the schedule that
    ``MPI_Iallreduce`` builds each time: a 264-byte exchange between two ranks took 6.9 against
    18.5 us under MPICH 5 after other work had run (4.0 against 8.1 under Open MPI 5)."""
    init = getattr(comm, "Allreduce_init", None)
    if init is None:
        return None
    try:
        return init(MPI.IN_PLACE, vector, op=MPI.BAND)
    except NotImplementedError:  # mpi4py built against an MPI without persistent collectives
        return None
