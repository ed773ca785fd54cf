"""Rank failure detection: when a rank dies or hangs, the others stop within a bounded time.

Every collective gradsync runs (a negotiation cycle, a data allreduce) includes every rank, so once a
rank is gone each survivor's coordinator ends up blocked in one of them: within one idle heartbeat
(:func:`gradsync.engine.stall_inspector.heartbeat_interval`), because an idle coordinator joins a cycle at
least that often. The blocking calls themselves stay as they are (docs/performance-notes.md, fact 2). A
*watchdog* thread per rank looks at them from outside:

* Every ``tick`` it wakes (an Event wait, not a busy loop), drains its own communicator, and checks
  how long the coordinator has been inside its current cycle or collective.
* Past ``suspect`` seconds the rank is *watching*: it sends a small liveness message (a *beacon*) to
  every other rank each tick, point to point and nonblocking, on the watchdog's own duplicate of the
  communicator, and notes when it last heard from each rank.
* A live rank cannot stay out of the call forever: its coordinator joins a cycle within a heartbeat,
  blocks there as well (the lost rank is missing from it too) and starts beaconing ``suspect``
  seconds later. So a rank from which nothing has arrived for ``silence`` seconds while this rank
  was watching is lost. The watchdog tells the other ranks its verdict (so they fail at once, all
  naming the same ranks), and the coordinator fails every pending and later operation with
  :class:`~gradsync.errors.RankFailureError`.
* A rank whose coordinator thread fails sends the same kind of notice about itself, so the others
  stop within a tick instead of waiting for the timeout.

With ``T = GRADSYNC_RANK_FAILURE_TIMEOUT_SECONDS`` and ``H`` the heartbeat (at most ``T / 4``):
``tick = T / 20`` (0.01 .. 1 s), ``suspect = 2 tick``, ``silence = T - H - suspect - 2 tick``. A
survivor is watching at most ``H + suspect + tick`` after the loss, and decides ``silence + tick``
later: within ``T``. A live rank's beacons are at most ``H + suspect + 2 tick`` apart, less than
``silence``. Nothing is sent while every cycle completes, so the steady state costs one
``time.monotonic()`` per cycle and per response in the coordinator and a watchdog wake-up per tick.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from mpi4py import MPI

from .protocol import Response

log = logging.getLogger("gradsync")

_BEACON, _LOST = 1, 2  # tags on the watchdog's communicator


@dataclasses.dataclass(frozen=True)
class LivenessTiming:
    """The periods of failure detection, in seconds, derived from the timeout (see the module doc)."""

    timeout: float
    heartbeat: float
    tick: float
    suspect: float
    silence: float

    @classmethod
    def from_timeout(cls, timeout: float, heartbeat: float) -> LivenessTiming:
        """Periods for ``timeout`` (> 0) given the idle ``heartbeat`` (at most ``timeout / 4``)."""
        tick = min(max(timeout / 20, 0.01), 1.0)
        suspect = 2 * tick
        return cls(timeout, heartbeat, tick, suspect, timeout - heartbeat - suspect - 2 * tick)


# What the coordinator is blocked in: (time.monotonic() when it started, a description or the
# Response it runs, see described()); None while it is not inside a cycle or collective.
Busy = tuple[float, object] | None


class Watchdog:
    """This rank's failure detector: a daemon thread with its own communicator, started by
    :meth:`start`.

    Args:
        comm: a duplicate of the coordinator's communicator, used by this thread only (and by
            :meth:`announce`).
        timing: the periods.
        busy: returns what the coordinator is blocked in now (:data:`Busy`).
        on_lost: called once, from this thread, with the lost ranks and the reason (one line that
            starts by naming them) when it decides, or hears, that ranks are lost.
    """

    def __init__(self, comm: MPI.Comm, timing: LivenessTiming, busy: Callable[[], Busy],
                 on_lost: Callable[[tuple[int, ...], str], None],
                 world_ranks: list[int] | None = None) -> None:
        """``world_ranks``: for a process set, the world rank of each of ``comm``'s ranks, which
        messages name (``on_lost`` still gets ``comm``'s ranks)."""
        self.comm = comm
        self.rank = comm.Get_rank()
        self._world_ranks = world_ranks
        self.timing = timing
        self._busy = busy
        self._on_lost = on_lost
        self._peers = [r for r in range(comm.Get_size()) if r != self.rank]
        self._heard = dict.fromkeys(self._peers, 0.0)
        self._sends: list[MPI.Request] = []
        self._lock = threading.Lock()  # _sends: announce() runs on the coordinator thread
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gradsync-watchdog", daemon=True)

    def start(self) -> None:
        """Start watching (once)."""
        self._thread.start()

    def announce(self, lost: tuple[int, ...], reason: str) -> None:
        """Tell every other rank that ``lost`` are lost (best effort, nonblocking), then stop."""
        self._send(_LOST, (lost, reason))
        self._stopping.set()

    def stop(self) -> None:
        """End the thread (it is never blocked in MPI), if it was started, and free the
        communicator."""
        self._stopping.set()
        if self._thread.ident is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._lock:
            self._sends.clear()
        self.comm.Free()

    def _run(self) -> None:
        watching = False
        try:
            while not self._stopping.wait(self.timing.tick):
                now = time.monotonic()
                notice = self._drain(now)
                if notice is not None:
                    self._on_lost(tuple(notice[0]), notice[1])
                    return
                busy = self._busy()
                if busy is None or now - busy[0] < self.timing.suspect:
                    watching = False
                    continue
                if not watching:  # every rank gets the benefit of the doubt from now on
                    watching = True
                    self._heard = dict.fromkeys(self._peers, now)
                self._send(_BEACON, None)
                lost = tuple(r for r in self._peers if now - self._heard[r] > self.timing.silence)
                if lost:
                    reason = self._verdict(lost, now, busy)
                    self._send(_LOST, (lost, reason))
                    self._on_lost(lost, reason)
                    return
        except BaseException:  # never die silently: say so (detection is off from here on)
            log.exception("gradsync: rank %d: the rank failure watchdog failed", self.rank)

    def _verdict(self, lost: tuple[int, ...], now: float, busy: tuple[float, object]) -> str:
        world = self._world_ranks or range(self.comm.Get_size())
        who = f"rank {world[lost[0]]}" if len(lost) == 1 else f"ranks {[world[r] for r in lost]}"
        silent = min(now - self._heard[r] for r in lost)
        return (f"{who} stopped responding (no liveness message to rank {world[self.rank]} for "
                f"{silent:.1f} s "
                f"while it waited {now - busy[0]:.1f} s in {described(busy[1])}; "
                f"GRADSYNC_RANK_FAILURE_TIMEOUT_SECONDS={self.timing.timeout:g}): its process died, was "
                "killed or hung")

    def _drain(self, now: float) -> tuple[tuple[int, ...], str] | None:
        """Receive every message that arrived; return a lost-ranks notice if one came."""
        status = MPI.Status()
        while True:
            try:
                message = self.comm.improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)
                if message is None:
                    return None
                payload = message.recv()
            except MPI.Exception as exc:  # some MPIs report a failed peer here; the silence decides
                log.debug("gradsync: rank %d: watchdog receive: %s", self.rank, exc)
                return None
            self._heard[status.Get_source()] = now
            if status.Get_tag() == _LOST:
                return payload

    def _send(self, tag: int, payload: object) -> None:
        with self._lock:
            for rank in self._peers:
                try:
                    self._sends.append(self.comm.isend(payload, dest=rank, tag=tag))
                except MPI.Exception as exc:
                    log.debug("gradsync: rank %d: watchdog send to rank %d: %s", self.rank, rank, exc)
            self._sends = [r for r in self._sends if not _completed(r)]


def _completed(request: MPI.Request) -> bool:
    try:
        return request.Test()
    except MPI.Exception:
        return True  # a send that failed is finished with


def watchdog_for(comm: MPI.Comm, timeout: float, heartbeat: float | None, busy: Callable[[], Busy],
                 on_lost: Callable[[tuple[int, ...], str], None],
                 world_ranks: list[int] | None = None) -> Watchdog | None:
    """A :class:`Watchdog`, not yet started, on a duplicate of ``comm`` (collective over it) for the
    failure ``timeout`` (seconds; 0: off, then None), given the coordinator's idle ``heartbeat``."""
    if timeout <= 0:
        return None
    return Watchdog(comm.Dup(), LivenessTiming.from_timeout(timeout, heartbeat), busy, on_lost,
                    world_ranks=world_ranks)


def _process_failure_classes() -> frozenset[int]:
    """MPI's error classes for a failed process (ULFM: MPI_ERR_PROC_FAILED, ..._PENDING,
    MPI_ERR_REVOKED), where the library has them (mpi4py gives absent ones MPI_ERR_UNKNOWN)."""
    classes = (MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING, MPI.ERR_REVOKED)
    return frozenset(c for c in classes if c != MPI.ERR_UNKNOWN)


def process_failure(exc: BaseException, comm: MPI.Comm) -> tuple[int, ...] | None:
    """The ranks of ``comm`` that failed, when ``exc`` is MPI's process-failure error (ULFM, e.g.
    Open MPI with ``mpiexec --with-ft ulfm``); () when MPI does not say which; None when ``exc`` is
    another error. On such an error ``comm`` is revoked, so that every survivor blocked in a
    collective on it gets the error too (MPI_ERR_REVOKED) instead of waiting."""
    if not isinstance(exc, MPI.Exception) or exc.Get_error_class() not in _process_failure_classes():
        return None
    try:
        comm.Revoke()
    except (MPI.Exception, NotImplementedError):
        pass
    try:
        failed = comm.Get_failed()
        ranks = MPI.Group.Translate_ranks(failed, list(range(failed.Get_size())), comm.Get_group())
        failed.Free()
    except (MPI.Exception, NotImplementedError, AttributeError):
        return ()
    return tuple(sorted(r for r in ranks if r != MPI.UNDEFINED))


def process_failure_reason(lost: tuple[int, ...], world: Callable[[int], int],
                           exc: BaseException) -> str:
    """The message of a process failure that MPI reported (``lost``: ranks of the communicator,
    named as world ranks by ``world``)."""
    named = [world(r) for r in lost]
    who = (f"rank {named[0]}" if len(named) == 1 else f"ranks {named}" if named
           else "another rank (MPI did not say which)")
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return f"{who} failed: MPI reported a process failure ({first})"


def described(what: object) -> str:
    """What the coordinator is busy with (:data:`Busy`), in words: a description as it is, or a
    response (the coordinator's hot path stores it as it is, described only when a verdict needs
    it)."""
    if not isinstance(what, Response):
        return str(what)
    names = ", ".join(repr(n) for n in what.names[:3])
    more = f" and {len(what.names) - 3} more" if len(what.names) > 3 else ""
    return f"{what.kind.name.lower()} {names}{more}"
