"""The device executor: plans of tensors in GPU memory, run on a CUDA stream of gradsync's own.

For every batch of device plans, on the thread running the coordinator's cycle:

1. the device's *communication stream* (one per device, created on first use) waits on the event
   each tensor's submission recorded on the caller's stream, so packing starts only after the
   kernels that produced the data, without blocking the host;
2. on that stream: :func:`gradsync.executors.plan.pack` into a device fusion buffer (a lone contiguous
   tensor is moved in its own memory), the backend (NCCL: every allreduce of the cycle in one
   ncclGroupStart/End; MPI: staged through pinned host memory), :func:`gradsync.executors.plan.unpack`;
3. record a *done* event on the stream and hand it to the handles: ``synchronize()`` makes the
   caller's current stream wait on it, so the host never blocks unless the user synchronizes.

Memory stays valid while the stream uses it: torch's caching allocator is told with
``record_stream``, and the watchdog (:mod:`gradsync.executors.device_watch`) holds every array
until the done event completed. Results (allgather) are allocated on the caller's stream, where the
caller frees them. Once the watchdog found an error, device plans fail with it (CollectiveError).
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ..arrays import dtypes
from ..arrays.device import DeviceRuntime, resolve_gpu_operations
from ..backends import nccl_api as nccl
from ..backends.mpi import MpiBackend
from ..engine.protocol import Kind, Response
from ..errors import CollectiveError
from . import Executed
from .device_watch import Clock, DeviceWatchdog, Outstanding, Timing
from .memory import DeviceMemory, FusionBuffers
from .plan import Context, FusionPlan, make_plan, pack, unpack

log = logging.getLogger("gradsync")


class GpuClaims:
    """Which process set drives NCCL communicators on each GPU of this process (shared by the
    coordinators of all sets, any thread). NCCL needs the communicators of one GPU to be used in
    one order on every rank ("Using multiple NCCL communicators concurrently"); the coordinators of
    different process sets run unordered, so a second set on a GPU is refused, clearly."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owners: dict[int, int] = {}  # device -> process set id

    def claim(self, device: int, process_set_id: int) -> int | None:
        """Claim ``device`` for ``process_set_id``; the id of the set that holds it, if another."""
        with self._lock:
            owner = self._owners.setdefault(device, process_set_id)
        return None if owner == process_set_id else owner

    def release(self, process_set_id: int) -> None:
        with self._lock:
            self._owners = {d: s for d, s in self._owners.items() if s != process_set_id}


class DeviceExecutor:
    """Runs device plans for one coordinator; see the module docstring.

    Args:
        comm: the coordinator's MPI communicator (for choosing the backend and NCCL unique ids).
        mpi: the coordinator's host backend (the staging path uses it).
        gpu_operations: the GRADSYNC_GPU_OPERATIONS setting ('', 'nccl' or 'mpi', any case).
        timeline: the coordinator's timeline, or None.
        on_error: called (from the watchdog thread) once an asynchronous error was recorded.
        world_ranks: for a process set, ``world_ranks[i]`` is the world rank of its rank ``i``.
        process_set_id, claims: this set's id and the process's :class:`GpuClaims`.
    """

    batched: frozenset[Kind] = frozenset({Kind.ALLREDUCE})

    def __init__(self, comm, mpi: MpiBackend, gpu_operations: str, timeline=None,
                 on_error: Callable[[], None] = lambda: None,
                 world_ranks: tuple[int, ...] | None = None, process_set_id: int = 0,
                 claims: GpuClaims | None = None) -> None:
        self._comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()  # within the coordinator's set
        self._world = tuple(world_ranks) if world_ranks is not None else tuple(range(self.size))
        self.world_rank = self._world[self.rank]
        self._mpi = mpi
        self._setting = gpu_operations
        self.timeline = timeline
        self._on_error = on_error
        self._set = process_set_id
        self._claims = claims if claims is not None else GpuClaims()
        self.backend = None
        self.device: tuple[DeviceRuntime, int] | None = None  # this rank's GPU, once it used one
        self._streams: dict[int, Any] = {}
        # Device fusion buffers, keyed (runtime, device, dtype), allocated on the communication
        # stream (the only one using them), so reusing one next cycle is stream-ordered.
        self._buffers = FusionBuffers(lambda key, count: key[0].empty(key[1], key[2], count))
        self._clocks: dict[int, Clock] = {}
        self._watchdog: DeviceWatchdog | None = None
        self._table = {Kind.ALLREDUCE: self._allreduce, Kind.BROADCAST: self._broadcast,
                       Kind.ALLGATHER: self._allgather}

    @property
    def error(self) -> str | None:
        """The asynchronous error the watchdog found (the device has failed), or None."""
        return self._watchdog.error if self._watchdog is not None else None

    @property
    def peer_failed(self) -> bool:
        """Whether :attr:`error` says that a peer failed (NCCL's remote error)."""
        return self._watchdog is not None and self._watchdog.peer_failed

    # ---- set-up ------------------------------------------------------------------------------
    def check_device(self, runtime: DeviceRuntime, device: int) -> str | None:
        """Why this rank may not submit a tensor on ``device`` (called before it is queued), or None.
        Each rank uses one GPU per set (NCCL communicators and the order of their first use must
        match), and with NCCL a GPU serves one process set."""
        if self.device is not None:
            used, index = self.device
            if index == device and used is runtime:
                return None
            return (f"this rank already moves tensors of {used.name} on cuda:{index}; gradsync uses "
                    f"one GPU per rank and one framework per GPU, but this is a {runtime.name} "
                    f"tensor on cuda:{device}")
        if resolve_gpu_operations(self._setting, nccl.nccl_built()) == "nccl":
            owner = self._claims.claim(device, self._set)
            if owner is not None:
                return (f"process set {owner} already runs NCCL collectives on cuda:{device}; NCCL "
                        "needs one order across the communicators of a GPU, which independent "
                        "process sets cannot give: run GPU collectives on one process set per GPU, "
                        "or set GRADSYNC_GPU_OPERATIONS=MPI")
        return None

    def claim(self, runtime: DeviceRuntime, device: int) -> None:
        """Record the GPU this rank uses (on its first device tensor)."""
        if self.device is None:
            self.device = (runtime, device)

    def _backend(self):
        """The backend, chosen on the first device collective, at the same point on every rank.

        Raises:
            CollectiveError: the ranks resolved GRADSYNC_GPU_OPERATIONS differently (on every rank).
        """
        if self.backend is None:
            choice = resolve_gpu_operations(self._setting, nccl.nccl_built())
            choices = self._comm.allgather(choice)
            if any(c != choice for c in choices):
                listed = ", ".join(f"rank {self._world[r]}: {c.upper()}" for r, c in enumerate(choices))
                raise CollectiveError(
                    f"gradsync: rank {self.world_rank}: the ranks move GPU tensors differently ({listed}): "
                    "set GRADSYNC_GPU_OPERATIONS to the same value (NCCL or MPI) on every rank, or "
                    "make NCCL load everywhere")
            if choice == "nccl":
                from ..backends.nccl import NcclBackend

                self.backend = NcclBackend(self._comm)
            else:
                from ..backends.staging import StagingBackend

                self.backend = StagingBackend(self._mpi)
            log.debug("gradsync: rank %d: GPU collectives through %s", self.world_rank, self.backend.name)
        return self.backend

    # ---- plans ---------------------------------------------------------------------------------
    def plan(self, response: Response, entries: list, divisor: int) -> FusionPlan:
        """See :meth:`gradsync.executors.Executor.plan`."""
        memory = DeviceMemory(entries[0].runtime, entries[0].device)
        context = Context(self.rank, self.size, divisor, memory, self._backend().traits)
        return make_plan(response, entries, context)

    def run(self, plans: list[FusionPlan]) -> Executed:
        """Enqueue ``plans`` (a batch of allreduces, or one broadcast or allgather) on the
        communication stream; see :meth:`gradsync.executors.Executor.run`.

        Raises:
            CollectiveError: the device has failed (the watchdog's error) or its backend was closed.
        """
        backend = self._backend()
        if self.error is not None or backend.closed is not None:
            raise CollectiveError(f"gradsync: rank {self.world_rank}: "
                                  f"{self.error or 'GPU collectives failed: the backend was closed'}")
        entries = [entry for plan in plans for entry in plan.entries]
        runtime, device = entries[0].runtime, entries[0].device
        done = self._table[plans[0].kind](runtime, device, backend, plans)
        return Executed(((f"ENQUEUE_{plans[0].kind.name}", time.perf_counter_ns()),),
                        (runtime, device, done))

    @contextlib.contextmanager
    def _on_comm_stream(self, runtime: DeviceRuntime, device: int, entries: list) -> Iterator[tuple]:
        """Make ``device``'s communication stream current, ordered after every entry's producer
        (its ``ready`` event); yields (stream, timing) for the work enqueued there."""
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = runtime.new_stream(device)
        with runtime.on_stream(stream, device):
            timing = self._timing(runtime, device, stream)
            for entry in entries:
                runtime.wait(stream, entry.ready)
            yield stream, timing

    def _allreduce(self, runtime: DeviceRuntime, device: int, backend, plans: list[FusionPlan]) -> Any:
        entries = [entry for plan in plans for entry in plan.entries]
        memory = DeviceMemory(runtime, device)
        with self._on_comm_stream(runtime, device, entries) as (stream, timing):
            buffers = self._fusion_buffers(runtime, device, plans)
            for plan, buffer in zip(plans, buffers):
                pack(plan, memory, buffer)
            packed = timing.mark()
            backend.allreduce(runtime, device, stream, [(buffer, plan.dtype, plan.reduction.send_op,
                                                         plan.reduction.logical)
                                                        for plan, buffer in zip(plans, buffers)])
            reduced = timing.mark()
            for plan, buffer in zip(plans, buffers):
                unpack(plan, memory, buffer)
            spans = timing.spans([e.request.name for e in entries],
                                 [("MEMCPY_IN_FUSION_BUFFER", packed), ("ALLREDUCE", reduced),
                                  ("MEMCPY_OUT_FUSION_BUFFER", timing.mark())])
            return self._finish(runtime, device, stream, entries, buffers, spans)

    def _fusion_buffers(self, runtime: DeviceRuntime, device: int, plans: list[FusionPlan]) -> list:
        """Per plan its buffer: the lone tensor's own memory, or its part of the cycle's fusion
        buffer of its dtype (one per dtype, the plans of the batch one after another)."""
        needed: dict[Any, int] = {}
        starts = []
        for plan in plans:
            starts.append(needed.get(plan.dtype, 0))
            if not plan.in_place:
                needed[plan.dtype] = starts[-1] + plan.count
        buffers = []
        for plan, start in zip(plans, starts):
            if plan.in_place:
                buffers.append(runtime.flat(plan.entries[0].target))
            else:
                whole = self._buffers.get((runtime, device, plan.dtype), needed[plan.dtype])
                buffers.append(whole[start:start + plan.count])
        return buffers

    def _broadcast(self, runtime: DeviceRuntime, device: int, backend, plans: list[FusionPlan]) -> Any:
        plan = plans[0]
        entry = plan.entries[0]
        memory = DeviceMemory(runtime, device)
        with self._on_comm_stream(runtime, device, [entry]) as (stream, timing):
            buffer = (runtime.flat(entry.target) if plan.in_place
                      else runtime.empty(device, plan.dtype, plan.count))
            pack(plan, memory, buffer)
            backend.broadcast(runtime, device, stream, buffer, plan.dtype, plan.root)
            unpack(plan, memory, buffer)
            spans = timing.spans([entry.request.name], [("BROADCAST", timing.mark())])
            return self._finish(runtime, device, stream, [entry], [buffer], spans)

    def _allgather(self, runtime: DeviceRuntime, device: int, backend, plans: list[FusionPlan]) -> Any:
        plan = plans[0]
        entries = list(plan.entries)
        for entry, shape in zip(entries, plan.out_shapes):
            with runtime.on_stream(entry.stream, device):  # the caller's stream, where it frees it
                entry.result, entry.target = entry.allocate(shape)
        memory = DeviceMemory(runtime, device)
        with self._on_comm_stream(runtime, device, entries) as (stream, timing):
            send = (runtime.flat(entries[0].source) if plan.in_place
                    else runtime.empty(device, plan.dtype, plan.count))
            pack(plan, memory, send)
            receive = (runtime.flat(entries[0].target) if plan.received_in_output
                       else runtime.empty(device, plan.dtype, sum(plan.counts)))
            backend.allgather(runtime, device, stream, send, receive, plan.dtype, list(plan.counts))
            unpack(plan, memory, receive)
            spans = timing.spans([e.request.name for e in entries], [("ALLGATHER", timing.mark())])
            return self._finish(runtime, device, stream, entries, [send, receive], spans)

    def stand_in(self, entry):
        """Move a joined rank's stand-in entry (host arrays: the op's identity, or no rows) to this
        rank's GPU, so that it takes part in the other ranks' device collective.

        Raises:
            GradsyncError: this rank has not used a GPU yet, so it has nothing to stand in with; a
                rank cannot skip the others' GPU collective, so this stops gradsync here and the
                liveness watchdog tells the others (RankFailureError) instead of letting them hang.
        """
        if self.device is None:
            from ..errors import GradsyncError

            raise GradsyncError(
                f"gradsync: rank {self.world_rank}: {entry.request.name!r}: this rank called join() "
                "before moving any GPU tensor, so it cannot take part in the other ranks' GPU "
                "collectives; submit one GPU collective before join()")
        runtime, device = self.device
        dtype = dtypes.NUMPY_DTYPES[entry.request.dtype]
        entry.runtime, entry.device = runtime, device
        entry.stream = runtime.current_stream(device)
        entry.source = runtime.from_host(device, entry.source)
        entry.target = entry.source if entry.target is not None else None
        if entry.allocate is not None:
            def allocate(shape: tuple[int, ...]) -> tuple[Any, Any]:
                result = runtime.empty(device, dtype, math.prod(shape))
                return result, result
            entry.allocate = allocate
        entry.ready = runtime.event(device)
        runtime.record(entry.ready, entry.stream)
        return entry

    # ---- completion, watchdog, timeline --------------------------------------------------------
    def _finish(self, runtime: DeviceRuntime, device: int, stream: Any, entries: list, buffers: list,
                spans: list) -> Any:
        """Record the done event; keep every array the stream uses alive until it completes."""
        keep = list(buffers)
        for entry in entries:
            for array in (entry.source, entry.target):
                if array is not None:
                    runtime.keep_alive(array, stream)
                    keep.append(array)
        done = runtime.event(device)
        runtime.record(done, stream)
        self._track(runtime, device, Outstanding(done, keep, spans, self._clocks.get(device)))
        return done

    def _timing(self, runtime: DeviceRuntime, device: int, stream: Any) -> Timing:
        """Timing events on ``stream`` for the timeline (inert without a timeline)."""
        if self.timeline is None:
            return Timing(None, device, None)
        if device not in self._clocks:
            self._clocks[device] = Clock(runtime, device, stream)
        return Timing(runtime, device, stream)

    def gpu_span(self, runtime: DeviceRuntime, device: int, row: str, phase: str, start: Any,
                 end: Any) -> None:
        """Timeline: a span between two timing events the caller recorded on ``device`` (e.g.
        backward on the compute stream), written once they completed. No-op without a timeline
        or before the first device collective (which starts the device's clock). Any thread."""
        clock = self._clocks.get(device)
        if self.timeline is not None and clock is not None:
            self._track(runtime, device, Outstanding(end, [], [(row, phase, start, end)], clock))

    def _track(self, runtime: DeviceRuntime, device: int, item: Outstanding) -> None:
        if self._watchdog is None:
            self._watchdog = DeviceWatchdog(runtime, device, self._backend(), self.timeline,
                                            self._on_error, f"rank {self.world_rank}")
            self._watchdog.start()
        self._watchdog.track(item)

    def close(self, abort: bool = False) -> None:
        """Stop the watchdog; destroy (or abort) the NCCL communicators. The coordinator's thread,
        after its last collective."""
        if self._watchdog is not None:
            self._watchdog.close()
        if self.backend is not None:
            self.backend.close(abort=abort)
        self._claims.release(self._set)
