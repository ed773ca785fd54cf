"""The background coordinator: request queue, negotiation cycles, and execution of agreed collectives.

One thread per process. It sleeps on a condition variable while there is nothing to do (no polling,
PERF-NOTES.md fact 3), wakes at once when a request is queued, and runs *cycles*:

1. take the newly queued requests;
2. ``gather`` them to rank 0, which answers with the ordered responses (:mod:`gradsync.negotiation`)
   by ``bcast``;
3. execute every response in that order with the backend, then complete the handles.

While some of its requests still wait for other ranks it cycles again after ``cycle_time`` ms (or at
once on a new request). Only this thread touches its communicator.

With rank failure detection on, it records when it entered each cycle and each collective
(:attr:`Coordinator.busy`), which the watchdog of :mod:`gradsync.liveness` reads to tell a rank that
died or hung from one that is merely slow.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from . import dtypes, fusion
from .autotune import Autotuner
from .backends.mpi import MpiBackend
from .config import Config, injected_fault
from .device import DeviceRuntime
from .device_executor import DeviceExecutor
from .errors import CollectiveError, GradsyncError, RankFailureError, ShutdownError, StallError
from .handles import Handle
from .liveness import LivenessTiming, Watchdog
from .negotiation import Negotiator
from .protocol import Kind, ReduceOp, Request, Response
from .stall_inspector import StallClock, heartbeat_interval

log = logging.getLogger("gradsync")


@dataclasses.dataclass(eq=False)
class Entry:
    """A request together with this rank's memory for it.

    ``source`` is a numpy view of the input; ``target`` a numpy view of where the result goes (the
    same object for in-place ops; None where the coordinator allocates it, as for allgather).
    ``result`` is what the handle returns; ``allocate`` makes it (and ``target``) when needed: from
    the output shape (allgather), or from the output shape and the rows received from each rank
    (alltoall, whose result is the pair (output, received splits)).
    For a tensor in device memory, ``source`` and ``target`` are device arrays of the framework
    whose :class:`~gradsync.device.DeviceRuntime` is ``runtime``, on CUDA device ``device``, and
    ``ready`` is the event recorded on the producer's stream at submission.
    """

    request: Request
    handle: Handle
    source: Any
    target: Any
    result: Any
    allocate: Callable[..., tuple[Any, Any]] | None = None
    submitted_ns: int = dataclasses.field(default_factory=time.perf_counter_ns)
    runtime: DeviceRuntime | None = None
    device: int = -1
    ready: Any = None


class TensorQueue:
    """Thread-safe queue of entries between the user's threads and the coordinator."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._entries: list[Entry] = []
        self._in_flight: set[str] = set()
        self._shutdown = False
        self._interrupted = False
        self.closed_error: BaseException | None = None

    def push(self, entry: Entry) -> None:
        """Queue ``entry`` and wake the coordinator.

        Raises:
            ValueError: a collective of the same name is still in flight on this rank.
            GradsyncError: the coordinator has stopped (the error says why).
        """
        with self._cond:
            self._check_free(entry)
            self._in_flight.add(entry.request.name)
            self._entries.append(entry)
            self._cond.notify()

    def push_all(self, entries: list[Entry]) -> None:
        """Queue every entry of ``entries`` at once (a group), or none of them; as :meth:`push`."""
        with self._cond:
            for entry in entries:
                self._check_free(entry)
            self._in_flight.update(entry.request.name for entry in entries)
            self._entries.extend(entries)
            self._cond.notify()

    def _check_free(self, entry: Entry) -> None:
        if self.closed_error is not None:
            raise self.closed_error
        name = entry.request.name
        if name in self._in_flight:
            raise ValueError(f"gradsync: rank {entry.request.rank}: a collective named {name!r} is "
                             f"still in flight; wait for its handle before reusing the name")

    def request_shutdown(self) -> None:
        with self._cond:
            self._shutdown = True
            self._cond.notify()

    def interrupt(self) -> None:
        """Wake the coordinator from another thread (the device watchdog found an error)."""
        with self._cond:
            self._interrupted = True
            self._cond.notify()

    def wait(self, timeout: float | None) -> tuple[list[Entry], bool]:
        """Block until there are entries, shutdown was asked for, :meth:`interrupt` was called, or
        ``timeout`` seconds passed.

        Returns the drained entries and whether shutdown was asked for.
        """
        with self._cond:
            if not self._entries and not self._shutdown and not self._interrupted:
                self._cond.wait(timeout)
            entries, self._entries = self._entries, []
            return entries, self._shutdown

    def finished(self, names: list[str]) -> None:
        with self._cond:
            self._in_flight.difference_update(names)

    def close(self, error: BaseException) -> list[Entry]:
        """Refuse further entries with ``error``, wake the coordinator; return those still queued."""
        with self._cond:
            self.closed_error = error
            entries, self._entries = self._entries, []
            self._in_flight.clear()
            self._cond.notify()
            return entries


class Coordinator:
    """The background thread of one process; see the module docstring."""

    def __init__(self, comm, config: Config, backend: MpiBackend | None = None,
                 world_ranks: list[int] | None = None, process_set_id: int = 0) -> None:
        """Start the thread. ``comm`` is used for negotiation; ``backend`` moves the data
        (default: an MpiBackend on ``comm``). Both belong to this thread alone from now on.

        For a process set other than the global one, ``world_ranks[i]`` is the world rank of the
        set's rank ``i`` (messages name world ranks) and ``process_set_id`` its id."""
        self.comm = comm
        self.rank = comm.Get_rank()  # the rank inside this coordinator's process set
        self.size = comm.Get_size()
        self.world_ranks = world_ranks
        self.world_rank = world_ranks[self.rank] if world_ranks is not None else self.rank
        self.process_set_id = process_set_id
        # The coordinators of this rank's other process sets (the runtime sets it), for stall reports.
        self.neighbours: Callable[[], list[Coordinator]] = list
        self.queue = TensorQueue()
        self._backend = backend if backend is not None else MpiBackend(comm)
        self._buffers = fusion.FusionBuffers()
        self._receive_buffers = fusion.FusionBuffers()  # reducescatter receives beside its send buffer
        _check_same_everywhere(comm, config)
        self.negotiator = Negotiator(comm, config, process_set_id, world_ranks)
        self._pending: dict[str, Entry] = {}
        self._executing: list[Entry] = []  # the entries of the response being carried out
        self._join_divisor = config.join_divisor
        failure_timeout = config.rank_failure_timeout_seconds if self.size > 1 else 0.0
        self._heartbeat = heartbeat_interval(config.stall_check_time_seconds, failure_timeout)
        # (time.monotonic() at entry, what) while inside a cycle or a collective; read by the watchdog.
        self.busy: tuple[float, object] | None = None
        self.failure: str | None = None  # why gradsync stopped, when MPI can no longer finish cleanly
        self.joins = 0  # join() calls completed on this set (the same count on every member)
        fault = injected_fault()
        injected_here = fault is not None and fault[1] == self.world_rank and world_ranks is None
        self._fault_cycle = fault[2] if injected_here else 0
        self._cycles = 0
        self._stall_clock = StallClock(config.stall_check_time_seconds,
                                       config.stall_shutdown_time_seconds)
        self._autotuner = None
        if config.autotune and self.rank == 0:
            self._autotuner = Autotuner(config.fusion_threshold, config.cycle_time,
                                        config.autotune_window)
        self.timeline = None
        if config.timeline:  # imported only when used, so `python -m gradsync.timeline` runs cleanly
            from .timeline import open_timeline

            self.timeline = open_timeline(config.timeline, self.world_rank, process_set_id)
        self._watchdog = None
        if failure_timeout > 0:
            timing = LivenessTiming.from_timeout(failure_timeout, self._heartbeat)
            self._watchdog = Watchdog(comm.Dup(), timing, lambda: self.busy, self._lost,
                                      world_ranks=world_ranks)
        self.device = DeviceExecutor(comm, self._backend, config.gpu_operations, self.timeline,
                                     on_error=lambda message: self.queue.interrupt(),
                                     world_ranks=world_ranks)
        self._thread = threading.Thread(target=self._run, name="gradsync-coordinator", daemon=True)
        self._thread.start()

    # ---- user side -------------------------------------------------------------------------
    def submit(self, entry: Entry) -> Handle:
        """Queue ``entry`` for negotiation; returns its handle at once.

        Raises:
            ValueError: a device tensor on another GPU (or of another framework) than this rank's
                earlier ones; a collective of the same name still in flight.
        """
        self._check_device(entry)
        self.queue.push(entry)
        return entry.handle

    def submit_group(self, entries: list[Entry]) -> list[Handle]:
        """Queue a group's entries together (all or none); returns their handles at once.

        Raises:
            ValueError: as :meth:`submit`, for any member (then none is queued).
        """
        for entry in entries:
            self._check_device(entry)
        self.queue.push_all(entries)
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

    # ---- coordinator thread ----------------------------------------------------------------
    def _run(self) -> None:
        crashed = False
        try:
            while True:
                timeout = self.negotiator.cycle_time / 1000.0 if self._pending else self._heartbeat
                entries, shutdown = self.queue.wait(timeout)
                if self.failure is not None:  # the watchdog stopped gradsync: run no more collectives
                    return
                # After a GPU error this rank stops; the cycle's shutdown flag stops the others too.
                shutdown = shutdown or self.device.error is not None
                for entry in entries:
                    self._pending[entry.request.name] = entry
                self._cycles += 1
                if self._cycles == self._fault_cycle:
                    raise RuntimeError(f"fault injected by GRADSYNC_TEST_FAULT at cycle {self._cycles}")
                started_ns = time.perf_counter_ns()
                stall = False
                if self._stall_clock.check_time > 0:
                    oldest = min((ns for _, ns in self._waited_on()), default=None)
                    stall = self._stall_clock.due(None if oldest is None else oldest / 1e9,
                                                  started_ns / 1e9)
                self.busy = (time.monotonic(), "a negotiation cycle")
                reply = self.negotiator.cycle([e.request for e in entries], shutdown, stall,
                                              self._pending_ages)
                self.busy = None
                replied_ns = time.perf_counter_ns()
                if self.timeline is not None and (entries or reply.responses):
                    self.timeline.marker("CYCLE", started_ns, {"new": len(entries),
                                                               "responses": len(reply.responses)})
                self._execute_all(reply.responses, replied_ns)
                if self.failure is not None:
                    return
                if self._autotuner is not None:
                    proposal = self._autotuner.poll()
                    if proposal is not None:
                        self.negotiator.propose(proposal)
                if self.device.error is not None:
                    self._stop(CollectiveError, self.device.error)
                    return
                if reply.stall_error is not None:
                    self._stop(StallError, reply.stall_error + self._set_ranks_note())
                    return
                if reply.shutdown_ranks:
                    ranks = [self._world(r) for r in reply.shutdown_ranks]
                    what = ("gradsync.shutdown() (or exited)" if self.world_ranks is None else
                            f"remove_process_set() on process set {self.process_set_id} or "
                            "gradsync.shutdown() (or exited)")
                    self._stop(ShutdownError, f"rank(s) {ranks} called {what} first")
                    return
        except BaseException as exc:  # the thread must never die silently
            crashed = True
            log.exception("gradsync: rank %d: coordinator failed", self.world_rank)
            self.busy = None
            if self.failure is not None:  # the watchdog's verdict came first and already said why
                return
            what = f"{type(exc).__name__}: {exc}".splitlines()[0]
            self.failure = f"the background coordinator failed: {what}"
            self._stop(GradsyncError, self.failure, cause=exc)
            if self._watchdog is not None:  # the others would wait for this rank: tell them now
                self._watchdog.announce((self.rank,), f"rank {self.world_rank}'s background coordinator "
                                        f"failed: {what}")
        finally:
            self.device.close(abort=crashed)  # after an error NCCL's pending work may never end
            if self.timeline is not None:
                self.timeline.close()

    def _world(self, rank: int) -> int:
        return rank if self.world_ranks is None else self.world_ranks[rank]

    def _set_ranks_note(self) -> str:
        """For a process set: which set a negotiation message is about (its ranks are world ranks)."""
        if self.world_ranks is None:
            return ""
        return f" (in process set {self.process_set_id}, world ranks {list(self.world_ranks)})"

    def _waited_on(self):
        """(name, submission time in ns) of the pending collectives a stall report is about; join()
        waits for the other ranks by design, so it is not one of them."""
        return ((name, e.submitted_ns) for name, e in self._pending.items()
                if e.request.kind != Kind.JOIN)

    def _pending_ages(self) -> tuple[tuple[str, float, int | None], ...]:
        """For a stall report: (name, seconds waited, None) of this set's pending collectives and
        (name, 0.0, set id) of those pending on this rank's other process sets, so that a name
        submitted to different sets by different ranks is reported as such."""
        now = time.perf_counter_ns()
        own = tuple((name, (now - ns) / 1e9, None) for name, ns in self._waited_on())
        others = tuple((name, 0.0, other.process_set_id) for other in self.neighbours()
                       if other is not self for name in list(other._pending))
        return own + others

    def _lost(self, lost: tuple[int, ...], reason: str) -> None:
        """The watchdog's verdict (on its thread): fail everything here with RankFailureError."""
        log.error("gradsync: rank %d: %s", self.world_rank, reason)
        self.failure = reason
        lost = tuple(self._world(r) for r in lost)
        self._stop(functools.partial(RankFailureError, lost_ranks=lost), reason)

    def _stop(self, error_type: Callable[[str], GradsyncError], reason: str,
              cause: BaseException | None = None) -> None:
        """Refuse new work and fail every pending handle, each with a message naming its tensor."""
        closed = error_type(f"gradsync: rank {self.world_rank}: gradsync has stopped: {reason}")
        closed.__cause__ = cause
        leftovers = self.queue.close(closed)
        for entry in list(self._pending.values()) + list(self._executing) + leftovers:
            request = entry.request
            error = error_type(f"gradsync: rank {self.world_rank}: {request.kind.name.lower()} "
                               f"{request.name!r} did not complete: {reason}")
            error.__cause__ = cause
            entry.handle._set_error(error)
        self._pending.clear()

    def _execute_all(self, responses: tuple[Response, ...], replied_ns: int) -> None:
        """Run the cycle's responses in order; the device allreduces among them are collected and
        run together (one NCCL group) before the next response of another kind, and at the end.
        Every rank makes the same batches, since ranks agree on every request's device."""
        batch: list[Response] = []
        for response in responses:
            if response.kind == Kind.ALLREDUCE and response.error is None and self._on_device(response):
                batch.append(response)
                continue
            if batch and not self._carry_out(batch, replied_ns):
                return
            batch = []
            if not self._carry_out([response], replied_ns):
                return
        if batch:
            self._carry_out(batch, replied_ns)

    def _carry_out(self, responses: list[Response], replied_ns: int) -> bool:
        """:meth:`_execute` with the watchdog told what this rank is inside; False once the watchdog
        has stopped gradsync (a rank was lost): then no further collective may start."""
        if self.failure is not None:
            return False
        self.busy = (time.monotonic(), _Described(responses[0]))
        try:
            self._execute(responses, replied_ns)
        finally:
            self.busy = None
        return self.failure is None

    def _on_device(self, response: Response) -> bool:
        entry = self._pending.get(response.names[0])
        request = entry.request if entry is not None else response.requests[0]
        return request.device != "cpu"

    def _entries(self, response: Response) -> list[Entry]:
        """This rank's entries of ``response``, or a joined rank's stand-ins."""
        if response.error is not None:  # a failed group may name members this rank never submitted
            return [self._pending.pop(name) for name in response.names if name in self._pending]
        stand_ins = dict(zip(response.names, response.requests))
        entries = []
        for name in response.names:
            entry = self._pending.pop(name, None)
            if entry is None:
                entry = _stand_in(stand_ins[name], self.rank, self.size)
                if entry.request.device != "cpu" and response.error is None:
                    entry = self.device.stand_in(entry)
            entries.append(entry)
        return entries

    def _execute(self, responses: list[Response], replied_ns: int) -> None:
        """Carry out ``responses`` (one, or a batch of device allreduces) and complete their handles."""
        groups = []
        for response in responses:
            try:
                groups.append((response, self._entries(response)))
            except CollectiveError as exc:
                groups.append((response._replace(error=str(exc)), []))
        everything = [entry for _, entries in groups for entry in entries]
        # Names are released before the handles complete: a caller that reuses a name right after
        # synchronize() returned must not find it still in flight.
        names = [name for r, _ in groups for name in r.names]
        response, entries = groups[0]
        self._executing = everything
        started_ns = time.perf_counter_ns()
        phases: list[tuple[str, int]] = []
        done = None  # the device collectives' done event
        try:
            for failed in groups:
                if failed[0].error is not None:
                    raise CollectiveError(f"gradsync: rank {self.world_rank}: {failed[0].error}"
                                          f"{self._set_ranks_note()}")
            device = entries[0].runtime is not None if entries else False
            if response.kind == Kind.ALLREDUCE and device:
                done = self.device.allreduce([(e, self._divisor(r)) for r, e in groups])
                phases = [("ENQUEUE_ALLREDUCE", time.perf_counter_ns())]
            elif response.kind == Kind.ALLREDUCE:
                phases = self._allreduce(entries, self._divisor(response))
            elif response.kind == Kind.BROADCAST and device:
                done = self.device.broadcast(entries[0])
                phases = [("ENQUEUE_BROADCAST", time.perf_counter_ns())]
            elif response.kind == Kind.REDUCESCATTER:
                phases = self._reducescatter(entries, self._divisor(response))
            elif response.kind == Kind.ALLTOALL:
                phases = self._alltoall(entries[0], response.split_matrix)
            elif response.kind == Kind.BROADCAST:
                phases = self._broadcast(entries[0])
            elif response.kind == Kind.ALLGATHER and device:
                done = self.device.allgather(entries[0], response.first_dims)
                phases = [("ENQUEUE_ALLGATHER", time.perf_counter_ns())]
            elif response.kind == Kind.ALLGATHER:
                phases = self._allgather(entries[0], response.first_dims)
            elif response.kind == Kind.JOIN:
                entries[0].result = self._world(response.first_dims[0])  # the rank that joined last
                self.joins += 1
            # BARRIER: negotiation itself proved that every rank arrived.
        except Exception as exc:
            error = exc
            if not isinstance(exc, CollectiveError):  # e.g. NcclError: fail the handles, then stop
                listed = ", ".join(repr(e.request.name) for e in everything)
                error = CollectiveError(f"gradsync: rank {self.world_rank}: {response.kind.name.lower()} "
                                        f"of {listed} failed: {type(exc).__name__}: {exc}")
                error.__cause__ = exc
            self.queue.finished(names)
            for entry in everything:
                entry.handle._set_error(error)
            if error is not exc:
                raise
        else:
            self.queue.finished(names)
            for entry in everything:
                self.negotiator.completed(entry.request)
                if done is None:
                    entry.handle._set_result(entry.result)
                else:
                    entry.handle._set_result(entry.result, (entry.runtime, entry.device, done))
            if self._autotuner is not None and response.kind == Kind.ALLREDUCE and done is None:
                self._autotuner.record(sum(entry.source.nbytes for entry in everything))
        finally:
            self._executing = []
            if self.timeline is not None:
                self._record(everything, replied_ns, started_ns, phases)

    def _divisor(self, response: Response) -> int:
        """What Average divides the sum by: the world size, or (GRADSYNC_JOIN_DIVISOR=contributors)
        the ranks that had not joined."""
        if self._join_divisor == "contributors" and response.contributors:
            return response.contributors
        return self.size

    def _record(self, entries: list[Entry], replied_ns: int, started_ns: int,
                phases: list[tuple[str, int]]) -> None:
        """Timeline spans of one response: phases are (name, end time), each starting where the
        previous one ended."""
        for entry in entries:
            name = entry.request.name
            self.timeline.span(name, "NEGOTIATE", entry.submitted_ns, replied_ns)
            self.timeline.span(name, "WAIT_FOR_DATA", replied_ns, started_ns)
            begin = started_ns
            for phase, end in phases:
                self.timeline.span(name, phase, begin, end, {"tensors": len(entries)})
                begin = end

    def _allreduce(self, entries: list[Entry], divisor: int) -> list[tuple[str, int]]:
        request = entries[0].request
        accumulator, logical, scale, floor_divisor = _reduction(request, divisor)
        only = entries[0]
        if (len(entries) == 1 and only.target.dtype == accumulator
                and only.target.flags.c_contiguous and only.target.flags.writeable):
            # Alone and contiguous: reduce in the output's own memory, no fusion copy.
            target = only.target
            phases = []
            if only.source is not target or request.prescale != 1.0:
                fusion.pack(only.source, target, request.prescale)
                phases.append(("MEMCPY_IN_FUSION_BUFFER", time.perf_counter_ns()))
            self._backend.allreduce(target.reshape(-1), request.op, logical)
            phases.append(("ALLREDUCE", time.perf_counter_ns()))
            fusion.unpack(target, target, scale, floor_divisor)
            if scale != 1.0 or floor_divisor != 1:
                phases.append(("MEMCPY_OUT_FUSION_BUFFER", time.perf_counter_ns()))
            return phases
        counts = [math.prod(e.request.shape) for e in entries]
        buffer = self._buffers.get(accumulator, sum(counts))
        offsets = np.cumsum([0] + counts).tolist()
        for entry, start, stop in zip(entries, offsets, offsets[1:]):
            fusion.pack(entry.source, buffer[start:stop], request.prescale)
        packed_ns = time.perf_counter_ns()
        self._backend.allreduce(buffer, request.op, logical)
        reduced_ns = time.perf_counter_ns()
        for entry, start, stop in zip(entries, offsets, offsets[1:]):
            fusion.unpack(buffer[start:stop], entry.target, scale, floor_divisor)
        return [("MEMCPY_IN_FUSION_BUFFER", packed_ns), ("ALLREDUCE", reduced_ns),
                ("MEMCPY_OUT_FUSION_BUFFER", time.perf_counter_ns())]

    def _reducescatter(self, entries: list[Entry], divisor: int) -> list[tuple[str, int]]:
        """MPI_Reduce_scatter of every entry's rows in one call: the send buffer holds, rank after
        rank, that rank's rows of each entry in turn (a lone contiguous tensor of the accumulator dtype
        is sent from its own memory, it is already in that order); each rank receives its rows of
        every entry."""
        request = entries[0].request
        accumulator, logical, scale, floor_divisor = _reduction(request, divisor)
        layouts = []  # per entry: (row offsets by rank, rows by rank, elements per row)
        for entry in entries:
            shape = entry.request.shape
            rows = fusion.split_rows(shape[0], self.size)
            layouts.append((np.cumsum([0] + rows).tolist(), rows, math.prod(shape[1:])))
        counts = [sum(rows[r] * width for _, rows, width in layouts) for r in range(self.size)]
        phases = []
        only = entries[0].source
        if (len(entries) == 1 and request.prescale == 1.0 and only.dtype == accumulator
                and only.flags.c_contiguous):
            send = only.reshape(-1)  # alone and contiguous: sent from its own memory, no copy
        else:
            send = self._buffers.get(accumulator, sum(counts))
            position = 0
            for r in range(self.size):
                for entry, (offsets, rows, width) in zip(entries, layouts):
                    part = entry.source[offsets[r]:offsets[r + 1]]
                    fusion.pack(part, send[position:position + rows[r] * width], request.prescale)
                    position += rows[r] * width
            phases.append(("MEMCPY_IN_FUSION_BUFFER", time.perf_counter_ns()))
        receive = self._receive_buffers.get(accumulator, counts[self.rank])
        self._backend.reducescatter(send, receive, counts, request.op, logical)
        phases.append(("REDUCESCATTER", time.perf_counter_ns()))
        position = 0
        for entry, (_, rows, width) in zip(entries, layouts):
            count = rows[self.rank] * width
            fusion.unpack(receive[position:position + count], entry.target, scale, floor_divisor)
            position += count
        return phases + [("MEMCPY_OUT_FUSION_BUFFER", time.perf_counter_ns())]

    def _alltoall(self, entry: Entry, matrix: tuple[tuple[int, ...], ...]) -> list[tuple[str, int]]:
        shape = entry.request.shape
        row_bytes = math.prod(shape[1:]) * entry.source.dtype.itemsize
        received = [row[self.rank] for row in matrix]
        result, target = entry.allocate((sum(received),) + tuple(shape[1:]), received)
        source = np.ascontiguousarray(entry.source)
        self._backend.alltoall(source, target, [n * row_bytes for n in matrix[self.rank]],
                               [n * row_bytes for n in received])
        entry.result = result
        return [("ALLTOALL", time.perf_counter_ns())]

    def _broadcast(self, entry: Entry) -> list[tuple[str, int]]:
        root = entry.request.root
        target = entry.target
        if self.rank == root and entry.source is not target:
            np.copyto(target, entry.source)
        if target.flags.c_contiguous:
            self._backend.broadcast(target, root)
            return [("BROADCAST", time.perf_counter_ns())]
        staging = np.ascontiguousarray(target)
        self._backend.broadcast(staging, root)
        np.copyto(target, staging)
        return [("BROADCAST", time.perf_counter_ns())]

    def _allgather(self, entry: Entry, first_dims: tuple[int, ...]) -> list[tuple[str, int]]:
        shape = entry.request.shape
        row_bytes = math.prod(shape[1:]) * entry.source.dtype.itemsize
        result, target = entry.allocate((sum(first_dims),) + tuple(shape[1:]))
        source = np.ascontiguousarray(entry.source)
        self._backend.allgather(source, target, [d * row_bytes for d in first_dims])
        entry.result = result
        return [("ALLGATHER", time.perf_counter_ns())]


def _reduction(request: Request, divisor: int) -> tuple[np.dtype, bool, float, int]:
    """How to reduce ``request`` (see :mod:`gradsync.dtypes`): the accumulator dtype, whether the
    data is logical (bool), the scale of the result (postscale, and 1/divisor for a floating
    Average) and the floor divisor of an integer Average (1: none)."""
    average = request.op == ReduceOp.Average
    integer_average = average and request.dtype in dtypes.INTEGER
    scale = request.postscale / divisor if average and not integer_average else request.postscale
    return (dtypes.accumulator(request.dtype, average), request.dtype == "bool", scale,
            divisor if integer_average else 1)


def _check_same_everywhere(comm, config: Config) -> None:
    """Settings that every rank must share (each rank plans cached fusion by itself)."""
    mine = (config.fusion_threshold, config.cache_capacity, config.join_divisor,
            config.rank_failure_timeout_seconds)
    everyone = comm.allgather(mine)
    if any(values != mine for values in everyone):
        listed = ", ".join(f"rank {r}: fusion_threshold={t}, cache_capacity={c}, join_divisor={j}, "
                           f"rank_failure_timeout_seconds={f:g}" for r, (t, c, j, f) in enumerate(everyone))
        raise GradsyncError(f"gradsync: GRADSYNC_FUSION_THRESHOLD, GRADSYNC_CACHE_CAPACITY, "
                            f"GRADSYNC_JOIN_DIVISOR and GRADSYNC_RANK_FAILURE_TIMEOUT_SECONDS must be the "
                            f"same on every rank; got {listed}")


class _Described:
    """A response, described in words only when a failure report needs it (the hot path stores it
    as is)."""

    __slots__ = ("response",)

    def __init__(self, response: Response) -> None:
        self.response = response

    def __str__(self) -> str:
        names = ", ".join(repr(n) for n in self.response.names[:3])
        more = f" and {len(self.response.names) - 3} more" if len(self.response.names) > 3 else ""
        return f"{self.response.kind.name.lower()} {names}{more}"


_IDENTITY = {ReduceOp.Average: "zero", ReduceOp.Sum: "zero", ReduceOp.Product: "one",
             ReduceOp.Min: "max", ReduceOp.Max: "min"}


def _stand_in(request: Request, rank: int, size: int) -> Entry:
    """A joined rank's contribution to a collective it did not submit: for allreduce and
    reducescatter the identity of the op (zeros for Sum/Average, ones for Product, the dtype's
    largest value for Min and smallest for Max; a reducescatter's rows for this rank are
    discarded), for allgather and alltoall no rows (what alltoall sends it is discarded), for
    broadcast a buffer to receive into."""
    dtype = dtypes.NUMPY_DTYPES[request.dtype]
    shape = request.shape
    if request.kind in (Kind.ALLGATHER, Kind.ALLTOALL):
        empty = np.empty((0,) + tuple(shape[1:]), dtype)

        def allocate(full_shape, *_):
            out = np.empty(full_shape, dtype)
            return out, out

        return Entry(request, Handle(request.name), empty, None, None, allocate)
    data = np.zeros(shape, dtype)
    target = data
    if request.kind == Kind.REDUCESCATTER:
        rows = fusion.split_rows(shape[0], size)[rank]
        target = np.empty((rows,) + tuple(shape[1:]), dtype)
    if request.kind in (Kind.ALLREDUCE, Kind.REDUCESCATTER):
        identity = _IDENTITY[request.op]
        if identity == "one":
            data[...] = 1
        elif identity != "zero":
            if request.dtype in dtypes.FLOATING:
                data[...] = np.inf if identity == "max" else -np.inf
            else:
                info = np.iinfo(np.uint8 if request.dtype == "bool" else dtype)
                data[...] = info.max if identity == "max" else info.min
    return Entry(request, Handle(request.name), data, target, None)
