"""The coordinator of one process set on this rank: its cycle, its thread, and how it stops.

A cycle (:meth:`Coordinator.cycle`):

1. take the newly queued requests (:mod:`gradsync.queue`);
2. negotiate with every rank which are ready everywhere (:mod:`gradsync.negotiation`): every rank
   gets the same ordered responses;
3. for each response, build this rank's plan (:mod:`gradsync.fusion`) with the executor of its
   memory and run it (:mod:`gradsync.executors`), then complete the handles.

One owner at a time: the coordinator's state (pending entries, executors, communicators) is touched
only by the thread running a cycle, which holds :attr:`Coordinator.lock`. That is the background
thread, which sleeps on the queue's condition variable while there is nothing to do (no polling,
PERF-NOTES.md fact 3) and cycles again after ``cycle_time`` ms while requests wait for other
ranks; or, with ``GRADSYNC_CALLER_RUNS`` (the default), a thread that waits for a host handle
whose collective has not run yet (a blocking op, ``synchronize()``): if the lock is free (the
background thread is idle) it runs the cycles itself until its handle is done
(:meth:`Coordinator.run_for`), with no hand-off to the background thread and back. Both run the
same :meth:`Coordinator.cycle`: which thread runs a cycle changes when cycles happen, never what
a cycle decides, and a rank's cycles are matched with the other ranks' in order whichever thread
runs them. A waiter that finds the lock taken waits on its handle's event (no spinning). Other
threads post to the queue (new entries, ``interrupt``, ``close``) or read snapshots
(:attr:`Coordinator.busy`, ``queue.pending_names()``).

With rank failure detection on, :attr:`Coordinator.busy` says since when the cycle is inside a
negotiation or a collective; the watchdog of :mod:`gradsync.liveness` reads it to tell a rank that
died or hung from one that is merely slow, and its verdict closes the queue (failing every handle
in flight there) without touching the coordinator's own state.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from . import joins, liveness
from .autotune import Autotuner
from .backends.mpi import MpiBackend
from .config import Config, check_shared
from .errors import CollectiveError, GradsyncError, RankFailureError, ShutdownError, StallError
from .executors import Executed, Executor, batches
from .executors.device import DeviceExecutor, GpuClaims
from .executors.host import HostExecutor
from .fusion import FusionPlan
from .handles import Handle
from .negotiation import Negotiator
from .protocol import CycleReply, Kind, Response
from .queue import Entry, ErrorType, TensorQueue
from .stall_inspector import StallClock, heartbeat_interval, pending_ages
from .timeline import open_for, record_collective

log = logging.getLogger("gradsync")



class Coordinator:
    """The coordinator of one process set; see the module docstring.

    Args:
        comm: its communicator (negotiation); ``backend`` moves host data (default: an MpiBackend
            on ``comm``). Both belong to the coordinator alone from now on.
        world_ranks: for a process set other than the global one, ``world_ranks[i]`` is the world
            rank of the set's rank ``i`` (messages name world ranks); ``process_set_id`` its id.
        gpu_claims: the process's :class:`~gradsync.executors.device.GpuClaims`.
    """

    def __init__(self, comm, config: Config, backend: MpiBackend | None = None,
                 world_ranks: list[int] | None = None, process_set_id: int = 0,
                 gpu_claims: GpuClaims | None = None) -> None:
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()  # within this coordinator's set
        self.world_ranks = world_ranks
        self.world_rank = self._world(self.rank)
        self.process_set_id = process_set_id
        # The coordinators of this rank's other process sets (the runtime sets it), for stall reports.
        self.neighbours: Callable[[], list[Coordinator]] = list
        self.lock = threading.Lock()  # held by the thread running a cycle
        self._turn: int | None = None  # the thread ident of a caller running cycles (holds lock)
        self._last_cycle = time.monotonic()  # when the last cycle ended (any thread)
        self.queue = TensorQueue(self.world_rank)
        check_shared(comm, config)
        self.negotiator = Negotiator(comm, config, process_set_id, world_ranks)
        self._pending: dict[str, Entry] = {}
        # The entries the last cycle completed, released when the next cycle starts; see _retire.
        self._retired: list[Entry] = []
        self._join_divisor = config.join_divisor
        failure_timeout = config.rank_failure_timeout_seconds if self.size > 1 else 0.0
        # Read when an op is submitted. Off with rank failure detection: a rank lost while a caller
        # is inside a blocking MPI call would leave that thread blocked for good, where the
        # watchdog's verdict can fail only threads that wait on a handle (docs/architecture.md).
        self.caller_runs = config.caller_runs and failure_timeout == 0
        self._heartbeat = heartbeat_interval(config.stall_check_time_seconds, failure_timeout)
        # (time.monotonic() at entry, what) while inside a cycle or a collective; read by the watchdog.
        self.busy: tuple[float, object] | None = None
        self.joins = 0  # join() calls completed on this set (the same count on every member)
        self._stall_clock = StallClock(config.stall_check_time_seconds,
                                       config.stall_shutdown_time_seconds)
        self._autotuner = None
        if config.autotune and self.rank == 0:
            self._autotuner = Autotuner(config.fusion_threshold, config.cycle_time,
                                        config.autotune_window)
        self.timeline = open_for(config.timeline, process_set_id, self.world_rank)
        self._watchdog = liveness.start(comm, failure_timeout, self._heartbeat, lambda: self.busy,
                                        self._lost, world_ranks)
        backend = backend if backend is not None else MpiBackend(comm)
        self.host = HostExecutor(backend, self.rank, self.size)
        self.device = DeviceExecutor(comm, backend, config.gpu_operations, self.timeline,
                                     on_error=self.queue.interrupt, world_ranks=world_ranks,
                                     process_set_id=process_set_id, claims=gpu_claims)
        self._thread = threading.Thread(target=self._run, name="gradsync-coordinator", daemon=True)
        self._thread.start()

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
        for entry in entries:
            self._check_device(entry)
        host = all(entry.runtime is None and entry.request.kind != Kind.JOIN for entry in entries)
        for entry in entries:
            if self.caller_runs and host:
                entry.handle._runner = self.run_for
        mine = self._turn == threading.get_ident()
        if mine and not host:  # device work and join() stay on the background thread
            self._end_turn()
            mine = False
        self.queue.push_all(entries, wake=not mine)  # in the caller's turn, the caller cycles
        return [entry.handle for entry in entries]

    def replace_timeline(self, timeline) -> None:
        """Write the timeline to ``timeline`` (a :class:`gradsync.timeline.Timeline`) from now on, or
        stop writing (None), closing the current one. Callable from any thread: the coordinator
        reads the attribute afresh each time, and a closed timeline ignores what is written to it,
        so stopping keeps the closed object (a thread between its None check and its call stays
        safe) rather than setting None."""
        old = self.timeline
        if timeline is not None:
            self.timeline = self.device.timeline = timeline
        if old is not None and old is not timeline:
            old.close()

    @contextlib.contextmanager
    def caller_turn(self) -> Iterator[None]:
        """Around a blocking op's submission and wait (ops.py): with caller runs, if the background
        thread is idle, this thread takes :attr:`lock` first, so that the push wakes nobody and
        :meth:`run_for` cycles here at once. Otherwise (lock taken, caller runs off, a GPU set) it
        does nothing and the op waits as an asynchronous one would."""
        if (not self.caller_runs or self.device.device is not None
                or not self.lock.acquire(blocking=False)):
            yield
            return
        self._turn = threading.get_ident()
        try:
            yield
        finally:
            if self._turn == threading.get_ident():
                self._end_turn()

    def _end_turn(self) -> None:
        """End a caller's turn. Requests left waiting for other ranks need the background thread's
        next cycle, whose wait was timed before them: wake it (else it sleeps on, as it should)."""
        left = bool(self._pending)
        self._turn = None
        self.lock.release()
        if left:
            self.queue.wake()

    def run_for(self, handle: Handle) -> None:
        """Caller runs: from the thread about to wait for ``handle``, run cycles until it is done,
        if this thread holds :attr:`lock` in its turn (:meth:`caller_turn`) or takes it now (the
        background thread is idle), and this set has moved no GPU tensor (device work stays on the
        background thread, whose GPU binding and streams it is); else return at once and let the
        caller wait on the handle's event. Never raises: a failed cycle fails the handles, as on
        the background thread, and the background thread then stops."""
        if self._turn == threading.get_ident():
            self._cycle_until(handle)
            return
        if self.device.device is not None or not self.lock.acquire(blocking=False):
            return
        self._turn = threading.get_ident()
        try:
            self._cycle_until(handle)
        finally:
            self._end_turn()

    def _cycle_until(self, handle: Handle) -> None:
        while not handle.done() and self.device.device is None:
            if not self._guarded_cycle():
                return

    def _guarded_cycle(self) -> bool:
        """:meth:`cycle` in a caller's thread: an exception is handled as the background thread's."""
        try:
            return self.cycle()
        except BaseException as exc:  # noqa: BLE001 - it fails every handle, as on the background thread
            self._crashed(exc)
            return False

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
        self._thread.join(timeout)
        ended = not self._thread.is_alive()
        if ended and self._watchdog is not None and self.failure is None:
            self._watchdog.stop()
        return ended

    # ---- the cycle -------------------------------------------------------------------------
    def _run(self) -> None:
        """The background thread: wait for work (or the cycle time, or the heartbeat), cycle."""
        crashed = False
        timeout, wakes = self._heartbeat, self.queue.wakes
        try:
            while True:
                self.queue.wait(timeout, wakes)
                with self.lock:  # a caller that ran cycles meanwhile wakes it after releasing it
                    wakes = self.queue.wakes
                    if self._due() and not self.cycle():
                        return
                    timeout = self._next_wait()
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
        cycle without new work is timed from its end (:attr:`_last_cycle`), as it always was."""
        try:
            return self._cycle()
        finally:
            self._last_cycle = time.monotonic()

    def _cycle(self) -> bool:
        if self.queue.closed:  # the watchdog stopped gradsync: run no more collectives
            return False
        self._retired = []  # the memory of the last cycle's tensors may go now (see _retire)
        entries, shutdown = self.queue.take()
        device_failed = self.device.error  # this cycle tells the others; the next one stops
        for entry in entries:
            self._pending[entry.request.name] = entry
        started_ns = time.perf_counter_ns()
        stall = self._stall_due(started_ns)
        self.busy = (time.monotonic(), "a negotiation cycle")
        reply = self.negotiator.cycle([e.request for e in entries], shutdown or bool(device_failed),
                                      stall, self._pending_ages)
        self.busy = None
        replied_ns = time.perf_counter_ns()
        if self.timeline is not None and (entries or reply.responses):
            self.timeline.marker("CYCLE", started_ns, {"new": len(entries),
                                                       "responses": len(reply.responses)})
        if not self._execute_all(reply.responses, replied_ns):
            return False
        if self._autotuner is not None:
            proposal = self._autotuner.poll()
            if proposal is not None:
                self.negotiator.propose(proposal)
        return self._carry_on(reply, device_failed)

    def _interval(self) -> float | None:
        """Seconds from one cycle to the next without new work: the cycle time while requests wait
        for other ranks, else the heartbeat (None: none)."""
        return self.negotiator.cycle_time / 1000.0 if self._pending else self._heartbeat

    def _due(self) -> bool:
        """Whether the background thread, woken, runs a cycle now: new work, a stop, or the
        interval since the last cycle (which a caller may have run meanwhile) has passed."""
        interval = self._interval()
        return (self.queue.has_work() or
                (interval is not None and time.monotonic() - self._last_cycle >= interval))

    def _next_wait(self) -> float | None:
        """How long the background thread sleeps before its next cycle, unless woken."""
        interval = self._interval()
        if interval is None:
            return None
        return max(0.0, self._last_cycle + interval - time.monotonic())

    def _stall_due(self, now_ns: int) -> bool:
        """Whether this rank asks for a stall report in this cycle."""
        return self._stall_clock.due_for(self._pending.values(), now_ns)

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
            self._stop(StallError, reply.stall_error + self._set_ranks_note())
        elif reply.shutdown_ranks:
            ranks = [self._world(r) for r in reply.shutdown_ranks]
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
        self.busy = None
        lost = liveness.process_failure(exc, self.comm)
        if lost is not None:  # MPI itself reported a failed process (ULFM): that rank, not this one
            reason = liveness.process_failure_reason(lost, self._world, exc)
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
        world = tuple(self._world(r) for r in lost)
        self.queue.close(functools.partial(RankFailureError, lost_ranks=world), reason, failure=True)

    def _stop(self, error_type: ErrorType, reason: str, cause: BaseException | None = None) -> None:
        """Refuse new work and fail every handle in flight (the cycle's thread)."""
        self.queue.close(error_type, reason, cause)
        self._pending.clear()

    def _world(self, rank: int) -> int:
        return rank if self.world_ranks is None else self.world_ranks[rank]

    def _set_ranks_note(self) -> str:
        """For a process set: which set a negotiation message is about (its ranks are world ranks)."""
        if self.world_ranks is None:
            return ""
        return f" (in process set {self.process_set_id}, world ranks {list(self.world_ranks)})"

    # ---- execution -------------------------------------------------------------------------
    def _execute_all(self, responses: tuple[Response, ...], replied_ns: int) -> bool:
        """Run the cycle's responses in order, in the batches of :func:`~gradsync.executors.batches`
        (every rank makes the same ones); False once gradsync stopped meanwhile."""
        return all(self._carry_out(batch, replied_ns)
                   for batch in batches(responses, self._on_device, self.device.batched))

    def _on_device(self, response: Response) -> bool:
        entry = self._pending.get(response.names[0])
        request = entry.request if entry is not None else response.requests[0]
        return request.device != "cpu"

    def _carry_out(self, responses: list[Response], replied_ns: int) -> bool:
        """:meth:`_execute` with the watchdog told what this rank is inside; False once gradsync
        has stopped (the watchdog's verdict): then no further collective may start."""
        if self.queue.closed:
            return False
        self.busy = (time.monotonic(), liveness.Described(responses[0]))
        try:
            self._execute(responses, replied_ns)
        finally:
            self.busy = None
        return not self.queue.closed

    def _execute(self, responses: list[Response], replied_ns: int) -> None:
        """Plan and run ``responses`` (one, or a batch) and complete their handles."""
        taken = [(response, self._entries(response)) for response in responses]
        everything = [entry for _, entries in taken for entry in entries]
        # Names are released before the handles complete: a caller that reuses a name right after
        # synchronize() returned must not find it still in flight.
        names = [name for response, _ in taken for name in response.names]
        started_ns = time.perf_counter_ns()
        executed = Executed()
        try:
            plans = [self._plan(response, entries) for response, entries in taken]
            executed = self._executor(plans[0]).run(plans)
        except Exception as exc:
            self._failed(responses[0], everything, names, exc)
        else:
            self._completed(responses[0], everything, names, executed)
        finally:
            if self.timeline is not None:
                record_collective(self.timeline, everything, replied_ns, started_ns, executed.phases)

    def _entries(self, response: Response) -> list[Entry]:
        """This rank's entries of ``response``, or a joined rank's stand-ins."""
        if response.error is not None:  # a failed group may name members this rank never submitted
            return [self._pending.pop(name) for name in response.names if name in self._pending]
        stand_ins = dict(zip(response.names, response.requests))
        entries = []
        for name in response.names:
            entry = self._pending.pop(name, None)
            if entry is None:
                entry = joins.stand_in(stand_ins[name], self.rank, self.size)
                if entry.request.device != "cpu":
                    entry = self.device.stand_in(entry)
            entries.append(entry)
        return entries

    def _plan(self, response: Response, entries: list[Entry]) -> FusionPlan:
        """The plan of ``response``, by the executor of its memory.

        Raises:
            CollectiveError: the response is a negotiated error (the same on every rank).
        """
        if response.error is not None:
            raise CollectiveError(f"gradsync: rank {self.world_rank}: {response.error}"
                                  f"{self._set_ranks_note()}")
        divisor = self.size
        if self._join_divisor == "contributors" and response.contributors:
            divisor = response.contributors  # Average over the ranks that had not joined
        return self._executor_for(entries).plan(response, entries, divisor)

    def _executor_for(self, entries: Sequence[Entry]) -> Executor:
        return self.device if entries and entries[0].runtime is not None else self.host

    def _executor(self, plan: FusionPlan) -> Executor:
        return self._executor_for(plan.entries)

    def _completed(self, response: Response, entries: list[Entry], names: list[str],
                   executed: Executed) -> None:
        self.queue.finished(names)
        if response.kind == Kind.JOIN:
            entries[0].result = self._world(response.last_joined)
            self.joins += 1
        for entry in entries:
            self.negotiator.completed(entry.request)
            entry.handle._set_result(entry.result, executed.completion)
        self._retire(entries)
        if self._autotuner is not None and response.kind == Kind.ALLREDUCE and executed.completion is None:
            self._autotuner.record(sum(entry.source.nbytes for entry in entries))

    def _retire(self, entries: list[Entry]) -> None:
        """Keep the completed ``entries`` (and so their tensors' memory) referenced until the next
        cycle starts. A training loop frees its gradients right after the step
        (``zero_grad(set_to_none=True)``); freed then, at the top of glibc's heap, 50 MB of them
        are returned to the system (heap trimming) and the next backward page-faults them back
        in (+25 ms per step on the MLP of benchmarks/train_step.py, 14k faults). Released at the
        next cycle, which the next backward's first gradient starts, they are freed below the
        new gradients and their pages are reused. The coordinator before the engine refactor
        held them so by accident (a loop variable); docs/architecture.md, "Memory of completed
        tensors"."""
        self._retired.extend(entries)

    def _failed(self, response: Response, entries: list[Entry], names: list[str],
                exc: Exception) -> None:
        """Fail the handles of ``entries`` with ``exc``; an error that is not a CollectiveError (an
        MPI or NCCL error, a bug) is raised again afterwards: it stops the coordinator."""
        error = exc
        if not isinstance(exc, CollectiveError):
            listed = ", ".join(repr(e.request.name) for e in entries)
            error = CollectiveError(f"gradsync: rank {self.world_rank}: {response.kind.name.lower()} "
                                    f"of {listed} failed: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
        self.queue.finished(names)
        for entry in entries:
            entry.handle._set_error(error)
        if error is not exc:
            raise exc

