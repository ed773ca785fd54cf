"""The stall inspector: report collectives that some ranks submitted and others did not.

Ranks that wait on such a collective ask for a report (a flag in the cycle); rank 0 then knows, from
its message table and from every rank's list of pending collectives, which ranks submitted each name
and which did not. It logs a warning after ``GRADSYNC_STALL_CHECK_TIME_SECONDS`` and, once
``GRADSYNC_STALL_SHUTDOWN_TIME_SECONDS`` has passed, makes the report the error with which every rank
shuts down, instead of hanging.

To keep this working while some rank is idle (its coordinator would otherwise sleep until it gets
work), an idle coordinator takes part in one negotiation cycle every quarter of the check time (a
*heartbeat*, at most every 15 s). Rank failure detection (:mod:`gradsync.engine.liveness`) needs the same
heartbeat; with both off, an idle coordinator sleeps until it gets work.
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Collection, Iterable, Iterator
from typing import Any

from .protocol import Kind

log = logging.getLogger("gradsync")

MAX_HEARTBEAT = 15.0  # seconds


def heartbeat_interval(*deadlines: float) -> float | None:
    """Seconds an idle coordinator sleeps before joining a cycle anyway; None: sleep until work.

    ``deadlines`` are the times (seconds; 0: off) within which something must be noticed on every
    rank: the stall check time, the rank failure timeout. The heartbeat is a quarter of the
    shortest, between 0.05 and 15 s.
    """
    active = [d for d in deadlines if d > 0]
    if not active:
        return None
    return min(max(min(active) / 4, 0.05), MAX_HEARTBEAT)


def waited_on(entries: Iterable[Any]) -> Iterator[tuple[str, int]]:
    """(name, submission time in perf_counter ns) of the pending ``entries``
    (gradsync.engine.request_queue.Entry) that a stall report is about; join() waits for the other ranks by
    design, so it is not one. An iterator: the stall clock takes its minimum every cycle, without a list."""
    return ((e.request.name, e.submitted_ns) for e in entries if e.request.kind is not Kind.JOIN)


def pending_ages(entries: Iterable[Any], others: list[tuple[int, Any]]
                 ) -> tuple[tuple[str, float, int | None], ...]:
    """For a stall report: (name, seconds waited, None) of the pending ``entries`` of this set, and
    (name, 0.0, set id) of what is in flight in the queues of this rank's other sets (``others``:
    (set id, TensorQueue) pairs), so that a name submitted to different sets by different ranks is
    reported as such."""
    now = time.perf_counter_ns()
    own = tuple((name, (now - ns) / 1e9, None) for name, ns in waited_on(entries))
    return own + tuple((name, 0.0, ident) for ident, queue in others for name in queue.pending_names())


_SUBMITTED = operator.itemgetter(1)  # the submission time of a (name, time) of waited_on
_SUBMITTED_NS = operator.attrgetter("submitted_ns")  # an entry's submission time


class StallClock:
    """When this rank should ask for a stall report: once its oldest pending collective has waited
    ``check_time``, then every ``check_time``, and at ``shutdown_time`` (if set)."""

    def __init__(self, check_time: float, shutdown_time: float) -> None:
        self.check_time = check_time
        self.shutdown_time = shutdown_time
        self._last_asked: float | None = None

    def due_for(self, entries: Collection[Any], now_ns: int) -> bool:
        """:meth:`due` for the oldest of the pending ``entries`` that a report is about.

        Every cycle asks, so the usual answer comes first, from the entries' oldest submission
        time alone (one C call): while every pending entry is younger than ``check_time``,
        nothing is due. (:meth:`due` would also forget its last ask when only join() entries are
        pending; not needed: entries submitted after that are younger than the ask.)"""
        if self.check_time <= 0:
            return False
        if entries and now_ns - min(map(_SUBMITTED_NS, entries)) < self.check_time * 1e9:
            return False
        oldest = min(map(_SUBMITTED, waited_on(entries)), default=None)
        return self.due(None if oldest is None else oldest / 1e9, now_ns / 1e9)

    def due(self, oldest_submitted: float | None, now: float) -> bool:
        """Whether to raise the stall flag now (``oldest_submitted``: None when nothing is pending)."""
        if self.check_time <= 0 or oldest_submitted is None:
            self._last_asked = None
            return False
        if now - oldest_submitted < self.check_time:
            return False
        asked = self._last_asked
        shutdown_at = oldest_submitted + self.shutdown_time if self.shutdown_time > 0 else None
        due = (asked is None or now - asked >= self.check_time
               or (shutdown_at is not None and asked < shutdown_at <= now))
        if due:
            self._last_asked = now
        return due


class StallInspector:
    """Rank 0's report builder."""

    def __init__(self, size: int, check_time: float, shutdown_time: float,
                 process_set_id: int = 0, world_ranks: tuple[int, ...] | None = None) -> None:
        """``world_ranks[i]``: the world rank of the process set's rank ``i`` (reports name world
        ranks); None for the global set."""
        self.size = size
        self.world = tuple(world_ranks) if world_ranks is not None else tuple(range(size))
        self.process_set_id = process_set_id
        self.check_time = check_time
        self.shutdown_time = shutdown_time

    def inspect(self, submitted: dict[str, set[int]], ages: dict[str, float],
                elsewhere: dict[str, dict[int, int]] | None = None) -> tuple[str | None, bool]:
        """The report on names waited on for at least the check time, and whether to shut down.

        Args:
            submitted: name -> the ranks known to have submitted it.
            ages: name -> seconds the oldest of its submissions has waited.
            elsewhere: name -> {rank: id of another process set on which that rank submitted it}.
        """
        elsewhere = elsewhere or {}
        stalled = sorted((n for n, ranks in submitted.items()
                          if len(ranks) < self.size and ages.get(n, 0.0) >= self.check_time),
                         key=lambda n: -ages[n])
        if not stalled:
            return None, False
        lines = [f"stall: {len(stalled)} collective(s) submitted by some ranks but not by "
                 f"others for more than {self.check_time:g} s:"]
        for name in stalled[:50]:
            have = sorted(submitted[name])
            missing = sorted(set(range(self.size)) - set(have))
            world = self.world
            line = (f"  {name!r} (waiting {ages[name]:.1f} s): submitted by rank(s) "
                    f"{[world[r] for r in have]}, missing on rank(s) {[world[r] for r in missing]}")
            other_sets = elsewhere.get(name, {})
            if other_sets:
                line += "; ranks disagree on process set: " + ", ".join(
                    [f"rank {world[r]}: process set {self.process_set_id}" for r in have]
                    + [f"rank {world[r]}: process set {other_sets[r]}" for r in missing
                       if r in other_sets])
            lines.append(line)
        if len(stalled) > 50:
            lines.append(f"  ... and {len(stalled) - 50} more")
        lines.append("Every rank must submit the same collectives (same names); a rank that is missing "
                     "one is still computing, has taken another code path, or has hung.")
        shut = self.shutdown_time > 0 and max(ages[n] for n in stalled) >= self.shutdown_time
        if shut:
            lines.append(f"Shutting gradsync down on every rank: the stall lasted more than "
                         f"GRADSYNC_STALL_SHUTDOWN_TIME_SECONDS={self.shutdown_time:g} s.")
        elif self.shutdown_time <= 0:
            lines.append("They keep waiting; set GRADSYNC_STALL_SHUTDOWN_TIME_SECONDS to make them fail "
                         "with this report after that many seconds.")
        return "\n".join(lines), shut
