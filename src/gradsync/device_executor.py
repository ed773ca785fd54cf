"""The GPU data path: how the coordinator carries out collectives of tensors in device memory.

For every device collective, on the coordinator thread:

1. the device's *communication stream* (one per device, created on first use) waits on the event
   each tensor's submission recorded on the producer's stream, so packing starts only after the
   kernels that produced the gradient, without blocking the host;
2. on that stream: pack into a device fusion buffer (the prescale folded into the copy; a lone
   contiguous tensor is reduced in its own memory), reduce with the backend (NCCL: every allreduce
   of the cycle in one ncclGroupStart/End; MPI: staged through pinned host memory), unpack with the
   postscale and the Average divisor folded into the copy;
3. record a *done* event on the stream and hand it to the handles: ``synchronize()`` makes the
   caller's current stream wait on it, so the host never blocks unless the user synchronizes.

The tensors' memory stays safe while the stream uses it: torch's caching allocator is told with
``record_stream``, and the executor holds a reference to every array until the done event
completes. A watchdog thread polls those events and, with NCCL, ``ncclCommGetAsyncError``: a failed
peer aborts the communicators (which ends their kernels) and stops gradsync with the error instead
of hanging. With a timeline, the spans of device work are measured with CUDA timing events.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from . import dtypes, fusion, nccl
from .backends.mpi import MpiBackend
from .device import DeviceRuntime, resolve_gpu_operations
from .errors import CollectiveError
from .protocol import ReduceOp

log = logging.getLogger("gradsync")

#: Seconds between two looks of the watchdog at outstanding device work.
POLL_INTERVAL = 0.002


@dataclasses.dataclass(eq=False)
class Outstanding:
    """Device work the watchdog waits for: its done event, what it must keep alive until then,
    and (timeline) the timing events of its phases."""

    runtime: DeviceRuntime
    done: Any
    keep: list
    spans: list[tuple[str, str, Any, Any]]  # (row, phase, start event, end event)
    clock: Clock | None = None


class Clock:
    """Converts CUDA timing events of one device to ``time.perf_counter_ns`` (for the timeline):
    a reference event is recorded and waited for once; later events are placed by their elapsed
    time since it."""

    def __init__(self, runtime: DeviceRuntime, stream: Any) -> None:
        self.runtime = runtime
        self.origin = runtime.event(timing=True)
        runtime.record(self.origin, stream)
        runtime.synchronize(self.origin)
        self.origin_ns = time.perf_counter_ns()

    def ns(self, event: Any) -> int:
        return self.origin_ns + int(self.runtime.elapsed_ms(self.origin, event) * 1e6)


class DeviceExecutor:
    """Carries out device collectives for one coordinator; see the module docstring.

    Args:
        comm: the coordinator's MPI communicator (for choosing the backend and NCCL unique ids).
        mpi: the coordinator's host backend (the staging path uses it).
        gpu_operations: the GRADSYNC_GPU_OPERATIONS setting ('', 'nccl' or 'mpi', any case).
        timeline: the coordinator's timeline, or None.
        on_error: called (from the watchdog thread) with the message of an asynchronous error.
        world_ranks: for a process set, ``world_ranks[i]`` is the world rank of its rank ``i``
            (messages name world ranks); None for the global set.
    """

    def __init__(self, comm, mpi: MpiBackend, gpu_operations: str, timeline=None,
                 on_error: Callable[[str], None] = lambda message: None,
                 world_ranks: tuple[int, ...] | None = None) -> None:
        self._comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()  # within the coordinator's set
        self._world = tuple(world_ranks) if world_ranks is not None else tuple(range(self.size))
        self.world_rank = self._world[self.rank]
        self._mpi = mpi
        self._setting = gpu_operations
        self.timeline = timeline
        self.backend = None
        self.device: tuple[DeviceRuntime, int] | None = None  # this rank's GPU, once it used one
        self._streams: dict[int, Any] = {}
        # Device fusion buffers, keyed (runtime, device, dtype). Allocated on the communication
        # stream, the only stream that uses them, so reusing one next cycle is ordered after this
        # cycle's unpack.
        self._buffers = fusion.FusionBuffers(lambda key, count: key[0].empty(key[1], key[2], count))
        self._clocks: dict[int, Clock] = {}
        self._on_error = on_error
        self.error: str | None = None
        self._outstanding: collections.deque[Outstanding] = collections.deque()
        self._cond = threading.Condition(threading.Lock())
        self._closed = False
        self._watchdog: threading.Thread | None = None

    # ---- set-up ------------------------------------------------------------------------------
    def check_device(self, runtime: DeviceRuntime, device: int) -> str | None:
        """Why this rank may not submit a tensor on ``device`` (called before it is queued), or None.
        Each rank uses one GPU: NCCL communicators and the order of their first use must match."""
        if self.device is None:
            return None
        if self.device[1] != device or self.device[0] is not runtime:
            used, index = self.device
            return (f"this rank already moves tensors of {used.name} on cuda:{index}; gradsync uses "
                    f"one GPU per rank and one framework per GPU, but this is a {runtime.name} "
                    f"tensor on cuda:{device}")
        return None

    def claim(self, runtime: DeviceRuntime, device: int) -> None:
        """Record the GPU this rank uses (on its first device tensor)."""
        if self.device is None:
            self.device = (runtime, device)

    def _stream(self, runtime: DeviceRuntime, device: int) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = runtime.new_stream(device)
        return stream

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
                from .backends.nccl import NcclBackend

                self.backend = NcclBackend(self._comm)
            else:
                from .backends.staging import StagingBackend

                self.backend = StagingBackend(self._mpi)
            log.debug("gradsync: rank %d: GPU collectives through %s", self.world_rank, self.backend.name)
        return self.backend

    @contextlib.contextmanager
    def _on_comm_stream(self, runtime: DeviceRuntime, device: int,
                        entries: list) -> Iterator[tuple[Any, Any, _Timing]]:
        """Make ``device``'s communication stream current, ordered after every entry's producer
        (its ``ready`` event); yields (backend, stream, timing) for the collective enqueued there."""
        backend = self._backend()
        stream = self._stream(runtime, device)
        with runtime.on_stream(stream, device):
            timing = self._timing(runtime, device, stream)
            for entry in entries:
                runtime.wait(stream, entry.ready)
            yield backend, stream, timing

    # ---- collectives -------------------------------------------------------------------------
    def allreduce(self, groups: list[tuple[list, int]]) -> Any:
        """Enqueue the allreduces of one cycle: ``groups`` holds, per response, its entries (in
        fusion order) and the Average divisor. Returns the done event."""
        entries = [entry for group, _ in groups for entry in group]
        runtime, device = entries[0].runtime, entries[0].device
        with self._on_comm_stream(runtime, device, entries) as (backend, stream, timing):
            plans = self._pack(runtime, device, backend, groups)
            packed = timing.mark()
            divided = backend.allreduce(runtime, device, stream,
                                        [(p.buffer, p.dtype, p.send_op, p.logical) for p in plans])
            reduced = timing.mark()
            for plan, already in zip(plans, divided):
                plan.unpack(runtime, already)
            spans = timing.spans([e.request.name for e in entries],
                                 [("MEMCPY_IN_FUSION_BUFFER", packed), ("ALLREDUCE", reduced),
                                  ("MEMCPY_OUT_FUSION_BUFFER", timing.mark())])
            return self._finish(runtime, device, stream, entries, [p.buffer for p in plans], spans)

    def _pack(self, runtime: DeviceRuntime, device: int, backend, groups: list[tuple[list, int]]):
        """Pack every response's tensors (prescale folded in); one _Plan per response. A lone
        contiguous tensor whose dtype the backend reduces as it is stays in its own memory."""
        layouts = []
        fused: dict[np.dtype, int] = {}  # elements of each fusion buffer dtype needed this cycle
        for entries, divisor in groups:
            request = entries[0].request
            dtype = backend.accumulator(request.dtype, request.op == ReduceOp.Average)
            lone = (len(entries) == 1 and dtypes.NUMPY_DTYPES[request.dtype] == dtype
                    and runtime.is_contiguous(entries[0].target))
            count = sum(math.prod(e.request.shape) for e in entries)
            start = 0 if lone else fused.get(dtype, 0)
            if not lone:
                fused[dtype] = start + count
            layouts.append((entries, divisor, dtype, lone, start, count))
        plans = []
        for entries, divisor, dtype, lone, start, count in layouts:
            request = entries[0].request
            if lone:
                buffer = runtime.flat(entries[0].target)
                if entries[0].source is not entries[0].target or request.prescale != 1.0:
                    runtime.pack(entries[0].source, buffer, request.prescale)
            else:
                buffer = self._buffers.get((runtime, device, dtype), fused[dtype])[start:start + count]
                offset = 0
                for entry in entries:
                    n = math.prod(entry.request.shape)
                    runtime.pack(entry.source, buffer[offset:offset + n], request.prescale)
                    offset += n
            average = request.op == ReduceOp.Average
            # NCCL's average divides by the size: with ranks joined, the divisor may differ.
            send_op = ReduceOp.Sum if average and divisor != self.size else request.op
            plans.append(_Plan(buffer, dtype, send_op, request.dtype == "bool", entries, lone,
                               request.postscale, divisor if average else 1,
                               request.dtype in dtypes.INTEGER))
        return plans

    def broadcast(self, entry) -> Any:
        """Enqueue the broadcast of ``entry`` from its root; returns the done event."""
        runtime, device = entry.runtime, entry.device
        request = entry.request
        dtype = dtypes.NUMPY_DTYPES[request.dtype]
        with self._on_comm_stream(runtime, device, [entry]) as (backend, stream, timing):
            contiguous = runtime.is_contiguous(entry.target)
            buffer = (runtime.flat(entry.target) if contiguous
                      else runtime.empty(device, dtype, math.prod(request.shape)))
            if self.rank == request.root and (entry.source is not entry.target or not contiguous):
                runtime.pack(entry.source, buffer, 1.0)
            backend.broadcast(runtime, device, stream, buffer, dtype, request.root)
            if not contiguous:
                runtime.unpack(buffer, entry.target, 1.0, 1)
            spans = timing.spans([request.name], [("BROADCAST", timing.mark())])
            return self._finish(runtime, device, stream, [entry], [buffer], spans)

    def allgather(self, entry, first_dims: tuple[int, ...]) -> Any:
        """Enqueue the allgather of ``entry`` (rank r gives ``first_dims[r]`` rows); sets
        ``entry.result``; returns the done event."""
        runtime, device = entry.runtime, entry.device
        shape = entry.request.shape
        dtype = dtypes.NUMPY_DTYPES[entry.request.dtype]
        row = math.prod(shape[1:])
        # Allocated on the caller's stream (not the communication stream), where the user frees it.
        entry.result, entry.target = entry.allocate((sum(first_dims),) + tuple(shape[1:]))
        with self._on_comm_stream(runtime, device, [entry]) as (backend, stream, timing):
            send = entry.source
            if runtime.is_contiguous(send):
                send = runtime.flat(send)
            else:
                send = runtime.empty(device, dtype, math.prod(shape))
                runtime.pack(entry.source, send, 1.0)
            backend.allgather(runtime, device, stream, send, runtime.flat(entry.target), dtype,
                              [d * row for d in first_dims])
            spans = timing.spans([entry.request.name], [("ALLGATHER", timing.mark())])
            return self._finish(runtime, device, stream, [entry], [send], spans)

    def stand_in(self, entry):
        """Move a joined rank's stand-in entry (host arrays: the op's identity, or no rows) to this
        rank's GPU, so that it takes part in the other ranks' device collective.

        Raises:
            CollectiveError: this rank has not used a GPU yet, so it has nothing to stand in with.
        """
        if self.device is None:
            raise CollectiveError(
                f"gradsync: rank {self.world_rank}: {entry.request.name!r}: this rank called join() before "
                "moving any GPU tensor, so it cannot take part in the other ranks' GPU collectives; "
                "submit one GPU collective before join()")
        runtime, device = self.device
        dtype = dtypes.NUMPY_DTYPES[entry.request.dtype]
        entry.runtime, entry.device = runtime, device
        entry.source = runtime.from_host(device, entry.source)
        entry.target = entry.source if entry.target is not None else None
        if entry.allocate is not None:
            def allocate(shape: tuple[int, ...]) -> tuple[Any, Any]:
                result = runtime.empty(device, dtype, math.prod(shape))
                return result, result
            entry.allocate = allocate
        entry.ready = runtime.event()
        runtime.record(entry.ready, runtime.current_stream(device))
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
        done = runtime.event()
        runtime.record(done, stream)
        self._track(Outstanding(runtime, done, keep, spans, self._clocks.get(device)))
        return done

    def _timing(self, runtime: DeviceRuntime, device: int, stream: Any) -> _Timing:
        """Timing events on ``stream`` for the timeline (inert without a timeline)."""
        if self.timeline is None:
            return _Timing(None, None)
        if device not in self._clocks:
            self._clocks[device] = Clock(runtime, stream)
        return _Timing(runtime, stream)

    def gpu_span(self, runtime: DeviceRuntime, device: int, row: str, phase: str, start: Any,
                 end: Any) -> None:
        """Timeline: a span between two timing events the caller recorded on ``device`` (e.g.
        backward on the compute stream), written once they completed. No-op without a timeline
        or before the first device collective (which starts the device's clock)."""
        if self.timeline is not None and device in self._clocks:
            self._track(Outstanding(runtime, end, [], [(row, phase, start, end)], self._clocks[device]))

    def _track(self, item: Outstanding) -> None:
        with self._cond:
            if self._watchdog is None and not self._closed:
                self._watchdog = threading.Thread(target=self._watch, name="gradsync-device-watchdog",
                                                  daemon=True)
                self._watchdog.start()
            self._outstanding.append(item)
            self._cond.notify()

    def _watch(self) -> None:
        """The watchdog thread: completes outstanding work in order, checks for NCCL async errors."""
        while True:
            with self._cond:
                while not self._outstanding and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                head = self._outstanding[0]
            try:
                if head.runtime.query(head.done):
                    with self._cond:
                        self._outstanding.popleft()
                    self._write(head)
                    continue
                error = self.backend.async_error() if self.backend is not None else None
            except Exception as exc:  # a CUDA error surfaces here first
                error = f"{type(exc).__name__}: {exc}"
            if error is not None:
                self._fail(error)
                return
            time.sleep(POLL_INTERVAL)

    def _write(self, item: Outstanding) -> None:
        for row, phase, start, end in item.spans:
            self.timeline.span(row, phase, item.clock.ns(start), item.clock.ns(end))

    def _fail(self, error: str) -> None:
        self.error = f"GPU collectives failed: {error}"
        log.error("gradsync: rank %d: %s; aborting the NCCL communicators", self.world_rank, self.error)
        try:
            if self.backend is not None:
                self.backend.close(abort=True)
        finally:
            self._on_error(self.error)

    def close(self, abort: bool = False) -> None:
        """Stop the watchdog; destroy (or abort) the NCCL communicators. Coordinator thread only,
        after its last collective."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._watchdog is not None:
            self._watchdog.join(5.0)
        if self.backend is not None and self.error is None:
            self.backend.close(abort=abort)
        self._outstanding.clear()


@dataclasses.dataclass
class _Plan:
    """One response's buffer on the device and how to finish it."""

    buffer: Any
    dtype: np.dtype
    send_op: ReduceOp
    logical: bool
    entries: list
    lone: bool  # the buffer is the tensor's own memory
    postscale: float
    divisor: int  # of an Average (1 otherwise)
    integer: bool

    def unpack(self, runtime: DeviceRuntime, already_divided: bool) -> None:
        """Copy the results out, the postscale and the Average divisor folded into the copy
        (integers: the floor of the exact mean)."""
        pending = 1 if already_divided else self.divisor
        scale, floor_divisor = (self.postscale, pending) if self.integer else (self.postscale / pending, 1)
        if self.lone:
            if scale != 1.0 or floor_divisor != 1:
                runtime.unpack(self.buffer, self.buffer, scale, floor_divisor)
            return
        offset = 0
        for entry in self.entries:
            count = math.prod(entry.request.shape)
            runtime.unpack(self.buffer[offset:offset + count], entry.target, scale, floor_divisor)
            offset += count


class _Timing:
    """Timing events recorded on a stream for the timeline; inert (None events) without one."""

    def __init__(self, runtime: DeviceRuntime | None, stream: Any) -> None:
        self._runtime, self._stream = runtime, stream
        self.start = self.mark()

    def mark(self) -> Any:
        if self._runtime is None:
            return None
        event = self._runtime.event(timing=True)
        self._runtime.record(event, self._stream)
        return event

    def spans(self, names: list[str], phases: list[tuple[str, Any]]) -> list:
        """(row, phase, start, end) for every name and phase; phases are (name, end event), each
        starting where the previous ended."""
        if self._runtime is None:
            return []
        spans, begin = [], self.start
        for phase, end in phases:
            spans += [(name, phase, begin, end) for name in names]
            begin = end
        return spans
