"""The coordinator of one process set on this rank: its cycle, its thread, and how it stops.

A cycle (:meth:`Coordinator.cycle`):

1. take the newly queued requests (:mod:`gradsync.engine.request_queue`);
2. negotiate with every rank which are ready everywhere (:mod:`gradsync.engine.negotiation`): every rank
   gets the same ordered responses;
3. for each response, build this rank's plan (:mod:`gradsync.engine.fusion`) with the executor of its
   memory and run it (:mod:`gradsync.executors`), then complete the handles.

One owner at a time: the coordinator's state (pending entries, executors, communicators) is touched
only by the thread running a cycle, which holds :attr:`Coordinator.lock`. That is the background
thread, which sleeps on the queue's condition variable while there is nothing to do (no
polling, docs/performance-notes.md, fact 3), lets asynchronous requests that arrive within
``cycle_time`` ms of the last cycle gather into the next one (unless a thread waits for one:
``queue.hurry``, a blocking op), and cycles again after ``cycle_time`` ms while requests wait for
other ranks; or, with caller runs (``GRADSYNC_CALLER_RUNS``, on by default), a thread that waits
for a host handle whose collective has not run yet (a blocking op, ``synchronize()``): if the lock
is free (the background thread is idle) it runs the cycles itself until its handle is done
(:meth:`gradsync.engine.caller_runs.CallerRuns.run_for`), with no hand-off to the background thread
and back. A caller waits on MPI only where it can leave (nonblocking calls, given up at its
deadline or once gradsync stopped); a cycle that would block it further is *parked*
(:meth:`Coordinator._park`): the caller leaves, and the next cycle, the background thread's, runs
the rest first. Both run the same :meth:`Coordinator.cycle`: which thread runs a cycle changes when cycles
happen, never what a cycle decides, and a rank's cycles are matched with the other ranks' in
order whichever thread runs them. A waiter that finds the lock taken waits on its handle's event
(no spinning). Other threads post to the queue (new entries, ``interrupt``, ``close``) or read
snapshots (:attr:`Coordinator.busy`, ``queue.pending_names()``).

With rank failure detection on, :attr:`Coordinator.busy` says since when the cycle is inside a
negotiation or a collective; the watchdog of :mod:`gradsync.engine.liveness` reads it to tell a rank that
died or hung from one that is merely slow, and its verdict closes the queue (failing every handle
in flight there) without touching the coordinator's own state.
"""

from __future__ import annotations

import functools
import logging
import operator
import threading
import time
from collections.abc import Callable
from typing import NoReturn

from ..backends.mpi import MpiBackend
from ..config import Config, check_shared
from ..errors import CollectiveError, GradsyncError, RankFailureError, ShutdownError, StallError
from ..executors.device import DeviceExecutor, GpuClaims
from ..executors.host import HostExecutor
from ..handles import Handle
from ..timeline import open_for
from . import fusion, liveness
from .autotune import Autotuner
from .caller_runs import CallerRuns
from .execution import ResponseExecution
from .negotiation import Negotiator, Parked
from .parts import CycleParts, SetPlace
from .protocol import CycleReply, Kind, Response
from .request_queue import Entry, ErrorType, TensorQueue
from .stall_inspector import StallClock, heartbeat_interval, pending_ages
from .waiting import LeftTurn

log = logging.getLogger("gradsync")
_REQUEST = operator.attrgetter("request")  # an entry's request, as one C call


class Coordinator:
    """The coordinator of one process set; see the module docstring.

    Built in one piece, started by :meth:`start`: the constructor starts no thread. It holds two
    helpers, each given what it uses explicitly (:mod:`gradsync.engine.parts`): :attr:`execution`
    (a :class:`~gradsync.engine.execution.ResponseExecution`: a cycle's responses planned, run and
    completed) and :attr:`turns` (a :class:`~gradsync.engine.caller_runs.CallerRuns`: a waiting
    caller's turn at running cycles, which the ops take through ``coordinator.turns``).

    Args:
        comm: its communicator (negotiation); ``backend`` moves host data (default: an MpiBackend
            on ``comm``). Both belong to the coordinator alone from now on. Collective over
            ``comm``: every member builds its coordinator at the same point.
        world_ranks: for a process set other than the global one, ``world_ranks[i]`` is the world
            rank of the set's rank ``i`` (messages name world ranks); ``process_set_id`` its id.
        gpu_claims: the process's :class:`~gradsync.executors.device.GpuClaims`.
    """

    def __init__(self, comm, config: Config, *, backend: MpiBackend | None = None,
                 world_ranks: list[int] | None = None, process_set_id: int = 0,
                 gpu_claims: GpuClaims | None = None) -> None:
        place = self.place = SetPlace.of(comm, world_ranks, process_set_id)
        self.comm, self.rank, self.size = comm, place.rank, place.size  # within this coordinator's set
        self.world_ranks, self.process_set_id, self.world_rank = world_ranks, process_set_id, place.world_rank
        # The coordinators of this rank's other process sets (the runtime sets it), for stall reports.
        self.neighbours: Callable[[], list[Coordinator]] = list
        self.lock = threading.Lock()  # held by the thread running a cycle
        self._last_cycle = time.monotonic()  # when the last cycle ended (any thread)
        self._pending: dict[str, Entry] = {}
        self._progressed = False  # the last cycle took new requests or ran collectives
        # (time.monotonic() at entry, what) while inside a negotiation; read by the watchdog, with
        # the execution's own while inside a collective (:attr:`busy`).
        self._negotiating: tuple[float, object] | None = None
        self._parked: Callable[[], bool] | None = None  # the rest of a cycle a caller left (_park)
        parts = self._build_parts(config, backend, gpu_claims)
        failure_timeout = config.rank_failure_timeout_seconds if self.size > 1 else 0.0
        self._heartbeat = heartbeat_interval(config.stall_check_time_seconds, failure_timeout)
        self._stall_clock = StallClock(config.stall_check_time_seconds,
                                       config.stall_shutdown_time_seconds)
        self._autotuner = _autotuner(config, self.rank)
        self.execution = ResponseExecution(parts, place, join_divisor=config.join_divisor,
                                           autotuner=self._autotuner, timeline=self.timeline)
        # Read when an op is submitted. Guarded with rank failure detection: a caller then waits on
        # MPI only in ways the watchdog's verdict can end (docs/architecture.md, "Threads").
        # The cycle is looked up at each call, so that a wrapper set on the coordinator sees the
        # caller's cycles too (tests/parallel/test_caller_runs.py records which thread ran them).
        self.turns = CallerRuns(parts, lock=self.lock, cycle=lambda: self.cycle(), crashed=self._crashed,
                                enabled=config.caller_runs, guarded=failure_timeout > 0)
        self._watchdog = liveness.watchdog_for(comm, failure_timeout, self._heartbeat, lambda: self.busy,
                                               self._lost, world_ranks)
        self._thread = threading.Thread(target=self._run, name="gradsync-coordinator", daemon=True)

    def _build_parts(self, config: Config, backend: MpiBackend | None,
                     gpu_claims: GpuClaims | None) -> CycleParts:
        """The queue, negotiator, timeline and executors (set as attributes too), in the order their
        collectives over ``comm`` run on every rank."""
        comm, place = self.comm, self.place
        self.queue = TensorQueue(self.world_rank)
        check_shared(comm, config)
        self.negotiator = Negotiator(comm, config, process_set_id=place.process_set_id,
                                     world_ranks=place.world_ranks)
        self.timeline = open_for(config.timeline, place.process_set_id, self.world_rank)
        backend = backend if backend is not None else MpiBackend(comm)
        self.host = HostExecutor(backend, self.rank, self.size)
        self.device = DeviceExecutor(comm, backend, config.gpu_operations, self.timeline,
                                     on_error=self.queue.interrupt, world_ranks=place.world_ranks,
                                     process_set_id=place.process_set_id, claims=gpu_claims)
        return CycleParts(self._pending, self.queue, self.negotiator, self.host, self.device)

    def start(self) -> None:
        """Start the background thread and, with rank failure detection on, the watchdog's. Called
        once by whoever built the coordinator (:mod:`gradsync.process.runtime`), once it is
        registered; :meth:`shutdown` works whether it was called or not."""
        if self._watchdog is not None:
            self._watchdog.start()
        self._thread.start()

    @property
    def caller_runs(self) -> bool:
        """Whether a caller waiting for a host handle may run the cycles (``GRADSYNC_CALLER_RUNS``,
        off with rank failure detection); read when an op is submitted, settable."""
        return self.turns.enabled

    @caller_runs.setter
    def caller_runs(self, value: bool) -> None:
        self.turns.enabled = value

    @property
    def busy(self) -> tuple[float, object] | None:
        """(time.monotonic() at entry, what) while the cycle is inside a negotiation or a
        collective, else None; the watchdog of :mod:`gradsync.engine.liveness` reads it."""
        return self._negotiating or self.execution.busy

    @property
    def joins(self) -> int:
        """join() calls completed on this set (the same count on every member)."""
        return self.execution.joins

    @property
    def failure(self) -> str | None:
        """Why gradsync stopped, when MPI can no longer finish cleanly (a lost rank, a failed
        coordinator); None otherwise."""
        return self.queue.failure

    # ---- user side -------------------------------------------------------------------------
    def submit(self, entry: Entry) -> Handle:
        """Queue ``entry`` for negotiation; returns its handle at once.

        Raises:
            ValueError: a device tensor on another GPU (or of another framework) than this rank's
                earlier ones; a collective of the same name still in flight.
        """
        return self.submit_group([entry])[0]

    def submit_group(self, entries: list[Entry]) -> list[Handle]:
        """Queue a group's entries together (all or none); returns their handles at once.

        Raises:
            ValueError: as :meth:`submit`, for any member (then none is queued).
        """
        host = True  # host memory only, and no join(): a caller may run the cycles
        for entry in entries:
            if entry.runtime is not None:
                self._check_device(entry)
                host = False
            elif entry.request.kind is Kind.JOIN:
                host = False
        turns = self.turns
        hurry, runner = self.queue.hurry, turns.run_for if turns.enabled and host else None
        handles = []
        for entry in entries:
            entry.handle.on_wait(hurry, runner)
            handles.append(entry.handle)
        mine = turns.mine()
        if mine and not host:  # device work and join() stay on the background thread
            turns.end_turn()
            mine = False
        self.queue.push_all(entries, wake=not mine)  # in the caller's turn, the caller cycles
        return handles

    def replace_timeline(self, timeline) -> None:
        """Write the timeline to ``timeline`` (a :class:`gradsync.timeline.Timeline`) from now on, or
        stop writing (None), closing the current one. Callable from any thread: the coordinator
        reads the attribute afresh each time, and a closed timeline ignores what is written to it,
        so stopping keeps the closed object (a thread between its None check and its call stays
        safe) rather than setting None."""
        old = self.timeline
        if timeline is not None:
            self.timeline = self.device.timeline = self.execution.timeline = timeline
        if old is not None and old is not timeline:
            old.close()

    def _check_device(self, entry: Entry) -> None:
        if entry.runtime is not None:
            reason = self.device.check_device(entry.runtime, entry.device)
            if reason is not None:
                raise ValueError(f"gradsync: rank {self.world_rank}: {entry.request.kind.name.lower()} "
                                 f"of tensor {entry.request.name!r}: {reason}")
            self.device.claim(entry.runtime, entry.device)

    def shutdown(self, timeout: float) -> bool:
        """Ask every rank to stop, wait up to ``timeout`` seconds; True if the thread ended.

        After a failure (:attr:`failure` set) it returns False at once: the thread may be blocked
        in MPI for good, waiting for a lost rank."""
        self.queue.request_shutdown()
        if self.failure is not None:
            return False
        if self._thread.ident is None:
            return self._close_unstarted(timeout)
        self._thread.join(timeout)
        ended = not self._thread.is_alive()
        if ended and self._watchdog is not None and self.failure is None:
            self._watchdog.stop()
        return ended

    def _close_unstarted(self, timeout: float) -> bool:
        """Shutdown before :meth:`start`: no other rank hears of it (nothing negotiates here); fail
        what was submitted and free what the thread would have. False if a caller running cycles
        (caller runs) keeps the lock for ``timeout`` seconds."""
        if not self.lock.acquire(timeout=timeout):
            return False
        try:
            self._stop(ShutdownError, "gradsync.shutdown() was called before the coordinator started")
            self.device.close(abort=False)
            if self.timeline is not None:
                self.timeline.close()
            if self._watchdog is not None:
                self._watchdog.stop()
        finally:
            self.lock.release()
        return True

    # ---- the cycle -------------------------------------------------------------------------
    def _run(self) -> None:
        """The background thread: wait for work (or the cycle time, or the heartbeat), cycle."""
        crashed = False
        timeout, batching, wakes = self._heartbeat, False, self.queue.wakes
        try:
            while True:
                self.queue.wait(timeout, wakes, batching)
                with self.lock:  # a caller that ran cycles meanwhile wakes it after releasing it
                    wakes = self.queue.wakes
                    if self._due() and not self.cycle():
                        return
                    timeout, batching = self._next_wait()
        except BaseException as exc:  # the thread must never die silently
            crashed = True
            self._crashed(exc)
        finally:
            # After an error or a lost rank, NCCL's pending work may never end: abort, do not wait.
            self.device.close(abort=crashed or self.failure is not None)
            if self.timeline is not None:
                self.timeline.close()

    def cycle(self) -> bool:
        """One negotiation cycle and the execution of its responses; False once this coordinator
        has stopped. The caller holds :attr:`lock` (any thread may, one at a time). The next
        cycle without new work is timed from its end (:attr:`_last_cycle`)."""
        try:
            return self._cycle()
        finally:
            self._last_cycle = time.monotonic()

    def _cycle(self) -> bool:
        if self.queue.closed:  # the watchdog stopped gradsync: run no more collectives
            return False
        if self._parked is not None:  # a caller left a cycle in the middle: finish it first
            if self.turns.waiter() is not None:  # not in a caller that must stay able to leave:
                self.queue.wake()  # the rest may block in MPI (what it was parked for)
                raise LeftTurn
            parked, self._parked = self._parked, None
            return parked()
        entries, shutdown = self.queue.take()
        device_failed = self.device.error  # this cycle tells the others; the next one stops
        for entry in entries:
            self._pending[entry.request.name] = entry
        started_ns = time.perf_counter_ns()
        stall = self._stall_clock.due_for(self._pending.values(), started_ns)  # ask for a report?
        wait = self.turns.waiter()
        self._negotiating = (time.monotonic(), "a negotiation cycle")
        try:
            reply = self.negotiator.cycle(list(map(_REQUEST, entries)), shutdown or bool(device_failed),
                                          stall, self._pending_ages, wait)
        except Parked as parked:
            self._park(functools.partial(self._resume, parked.resume, len(entries), device_failed,
                                         started_ns))
        finally:
            self._negotiating = None
        return self._negotiated(reply, len(entries), device_failed, started_ns, wait)

    def _park(self, rest: Callable[[], bool]) -> NoReturn:
        """A caller leaves its turn in the middle of a cycle: ``rest`` finishes it, first thing in
        the next cycle of whichever thread (the background thread's, woken now)."""
        self._parked = rest
        self.queue.wake()
        raise LeftTurn

    def _resume(self, resume: Callable, new: int, device_failed: str | None, started_ns: int) -> bool:
        """The rest of a negotiation a caller left (:class:`~gradsync.engine.negotiation.Parked`)."""
        wait = self.turns.waiter()
        self._negotiating = (time.monotonic(), "a negotiation cycle")
        try:
            reply = resume(wait)
        except Parked as parked:
            self._park(functools.partial(self._resume, parked.resume, new, device_failed, started_ns))
        finally:
            self._negotiating = None
        return self._negotiated(reply, new, device_failed, started_ns, wait)

    def _negotiated(self, reply: CycleReply, new: int, device_failed: str | None, started_ns: int,
                    wait: Callable | None) -> bool:
        """The cycle after its negotiation: run the responses (in a caller's turn with ``wait``,
        only responses whose every wait can leave the turn, :meth:`_quick`; else parked)."""
        replied_ns = time.perf_counter_ns()
        if self.timeline is not None and (new or reply.responses):
            self.timeline.marker("CYCLE", started_ns, {"new": new, "responses": len(reply.responses)})
        self._progressed = bool(new or reply.responses)
        if wait is not None and not self._quick(reply.responses):
            self._park(functools.partial(self._executed, reply, device_failed, replied_ns))
        return self._executed(reply, device_failed, replied_ns)

    def _quick(self, responses: tuple[Response, ...]) -> bool:
        """Whether a caller's turn may run ``responses`` itself: each a failure (no collective) or
        a host allreduce whose fusion buffer the backend reduces with nonblocking MPI calls only
        (:meth:`gradsync.backends.mpi.MpiBackend.waits_nonblocking`), so that the turn can leave."""
        backend = self.host.backend
        if not getattr(backend, "waits_nonblocking", False):
            return False
        pending = self._pending
        for response in responses:
            if response.error is not None:
                continue
            if response.kind is not Kind.ALLREDUCE:
                return False
            total = 0
            for name in response.names:
                entry = pending.get(name)
                if entry is None or entry.runtime is not None:
                    return False
                request = entry.request
                total += fusion.nbytes(request)
            if not backend.waits_nonblocking(total, request.op):
                return False
        return True

    def _executed(self, reply: CycleReply, device_failed: str | None, replied_ns: int) -> bool:
        """Run the reply's responses (in a caller's turn, waiting as :meth:`CallerRuns.waiter`
        says for data), then what ends a cycle."""
        wait = self.turns.waiter(data=True)
        backend = self.host.backend
        if wait is not None:
            backend.wait = wait
        try:
            if not self.execution.run(reply.responses, replied_ns):
                return False
        finally:
            if wait is not None:
                backend.wait = None
        if self._autotuner is not None:
            proposal = self._autotuner.poll()
            if proposal is not None:
                self.negotiator.propose(proposal)
        return self._carry_on(reply, device_failed)

    def _interval(self) -> float | None:
        """Seconds from one cycle to the next without new work: the cycle time while requests wait
        for other ranks, else the heartbeat (None: none). 0 while a thread waits for one of them
        and the last cycle made progress: the others are on their way to the same request (the end
        of backward: the layout exchange queued during the bucket's cycle), and this rank's next
        cycle is what their cycle with it waits for. After a cycle without progress (a stall) the
        cycle time paces the retries again."""
        if not self._pending:
            return self._heartbeat
        if self._progressed and any(entry.handle.waited for entry in self._pending.values()):
            return 0.0
        return self.negotiator.cycle_time / 1000.0

    def _due(self) -> bool:
        """Whether the background thread, woken, runs a cycle now: new requests once the cycle
        time has passed since the last cycle (which a caller may have run meanwhile), so that
        asynchronous requests arriving together (gradients during backward) share a cycle; at
        once when a thread waits for one (a blocking op, synchronize()) or gradsync stops; without
        new work, once the interval since the last cycle has passed."""
        if self._parked is not None:
            return True
        since = time.monotonic() - self._last_cycle
        if self.queue.has_work():
            return self.queue.pressing() or since >= self.negotiator.cycle_time / 1000.0
        interval = self._interval()
        return interval is not None and since >= interval

    def _next_wait(self) -> tuple[float | None, bool]:
        """How long the background thread sleeps before its next cycle unless woken, and whether
        it is batching new requests (then only a waiting thread or a stop wakes it early)."""
        if self._parked is not None:
            return 0.0, False
        if self.queue.has_work():
            gap = self.negotiator.cycle_time / 1000.0
            return max(0.0, self._last_cycle + gap - time.monotonic()), True
        interval = self._interval()
        if interval is None:
            return None, False
        return max(0.0, self._last_cycle + interval - time.monotonic()), False

    def _pending_ages(self) -> tuple[tuple[str, float, int | None], ...]:
        """For a stall report: this set's pending collectives and, from a snapshot of their queues,
        those in flight on this rank's other process sets."""
        others = [(other.process_set_id, other.queue) for other in self.neighbours() if other is not self]
        return pending_ages(self._pending.values(), others)

    def _carry_on(self, reply: CycleReply, device_failed: str | None) -> bool:
        """After a cycle: stop (False) on a GPU failure, a stall report that shuts down, or a rank
        that asked to shut down; the reply is the same on every rank, so they stop together."""
        if device_failed:  # a peer NCCL lost is a rank failure, whose rank NCCL does not name
            self._stop(RankFailureError if self.device.peer_failed else CollectiveError, device_failed)
        elif reply.stall_error is not None:
            self._stop(StallError, reply.stall_error + self.place.note())
        elif reply.shutdown_ranks:
            ranks = [self.place.world(r) for r in reply.shutdown_ranks]
            what = ("gradsync.shutdown() (or exited)" if self.world_ranks is None else
                    f"remove_process_set() on process set {self.process_set_id} or "
                    "gradsync.shutdown() (or exited)")
            self._stop(ShutdownError, f"rank(s) {ranks} called {what} first")
        else:
            return True
        return False

    # ---- stopping --------------------------------------------------------------------------
    def _crashed(self, exc: BaseException) -> None:
        """The cycle raised: fail everything, and tell the other ranks, who would wait for this one."""
        self._negotiating = self.execution.busy = None
        lost = liveness.process_failure(exc, self.comm)
        if lost is not None:  # MPI itself reported a failed process (ULFM): that rank, not this one
            reason = liveness.process_failure_reason(lost, self.place.world, exc)
            if self._watchdog is not None:
                self._watchdog.announce(lost, reason)
            self._lost(lost, reason)
            return
        log.exception("gradsync: rank %d: coordinator failed", self.world_rank)
        what = f"{type(exc).__name__}: {exc}".splitlines()[0]
        if self.queue.close(GradsyncError, f"the background coordinator failed: {what}", exc,
                            failure=True) and self._watchdog is not None:
            self._watchdog.announce((self.rank,), f"rank {self.world_rank}'s background coordinator "
                                    f"failed: {what}")

    def _lost(self, lost: tuple[int, ...], reason: str) -> None:
        """Ranks ``lost`` (of this set) are gone (the watchdog's verdict, on its thread; or MPI's
        process-failure error): fail everything in flight with RankFailureError. Any thread."""
        log.error("gradsync: rank %d: %s", self.world_rank, reason)
        world = tuple(self.place.world(r) for r in lost)
        self.queue.close(functools.partial(RankFailureError, lost_ranks=world), reason, failure=True)

    def _stop(self, error_type: ErrorType, reason: str, cause: BaseException | None = None) -> None:
        """Refuse new work and fail every handle in flight (the cycle's thread)."""
        self.queue.close(error_type, reason, cause)
        self._pending.clear()


def _autotuner(config: Config, rank: int) -> Autotuner | None:
    """Rank 0's autotuner when ``GRADSYNC_AUTOTUNE`` is on (it proposes settings to the others)."""
    if not (config.autotune and rank == 0):
        return None
    return Autotuner(config.fusion_threshold, config.cycle_time, config.autotune_window)
