"""The device watchdog: a thread that waits for the device work the coordinator enqueued.

It completes outstanding work in order (releasing the arrays the stream used, writing the
timeline spans measured with CUDA timing events) and polls the backend's asynchronous error
(``ncclCommGetAsyncError``). On an error it records it once, aborts the backend's communicators
(the backend's own lock makes that safe beside the coordinator, which may be blocked in MPI), and
wakes the coordinator, which stops. It owns nothing of the coordinator's: it talks to it through
:attr:`DeviceWatchdog.error` (written once) and the ``on_error`` callback (the queue's interrupt).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("gradsync")

#: Seconds between two looks of the watchdog at outstanding device work.
POLL_INTERVAL = 0.002


class Clock:
    """Converts CUDA timing events of one device to ``time.perf_counter_ns`` (for the timeline):
    a reference event is recorded and waited for once; later events are placed by their elapsed
    time since it."""

    def __init__(self, runtime: Any, device: int, stream: Any) -> None:
        self.runtime = runtime
        self.origin = runtime.event(device, timing=True)
        runtime.record(self.origin, stream)
        runtime.synchronize(self.origin)
        self.origin_ns = time.perf_counter_ns()

    def ns(self, event: Any) -> int:
        return self.origin_ns + int(self.runtime.elapsed_ms(self.origin, event) * 1e6)


@dataclasses.dataclass(eq=False)
class Outstanding:
    """Device work the watchdog waits for: its done event, what it must keep alive until then,
    and (timeline) the timing events of its phases."""

    done: Any
    keep: list
    spans: list[tuple[str, str, Any, Any]]  # (row, phase, start event, end event)
    clock: Clock | None = None


class DeviceWatchdog:
    """The thread of one coordinator's device work; started by the first :meth:`track`.

    Args:
        runtime, device: the GPU (the thread binds it before touching any event).
        backend: the device backend, polled for asynchronous errors and aborted on one.
        timeline: where finished spans go (or None).
        on_error: called once, from this thread, after an error was recorded.
        label: names this rank in the log.
    """

    def __init__(self, runtime: Any, device: int, backend: Any, timeline: Any,
                 on_error: Callable[[], None], label: str) -> None:
        self._runtime, self._device, self._backend = runtime, device, backend
        self._timeline = timeline
        self._on_error = on_error
        self._label = label
        self.error: str | None = None  # written once, by this thread
        self.peer_failed = False  # the error says a peer failed (set before ``error``)
        self._outstanding: collections.deque[Outstanding] = collections.deque()
        self._cond = threading.Condition(threading.Lock())
        self._closed = False
        self._thread = threading.Thread(target=self._watch, name="gradsync-device-watchdog",
                                        daemon=True)

    def start(self) -> None:
        """Start the thread that waits for the tracked work (once, before the first :meth:`track`)."""
        self._thread.start()

    def track(self, item: Outstanding) -> None:
        """Wait for ``item`` (any thread)."""
        with self._cond:
            self._outstanding.append(item)
            self._cond.notify()

    def close(self) -> None:
        """Stop the thread and drop what it waited for (after the coordinator's last collective)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(5.0)
        with self._cond:
            self._outstanding.clear()

    def _next(self) -> Outstanding | None:
        with self._cond:
            while not self._outstanding and not self._closed:
                self._cond.wait()
            return None if self._closed else self._outstanding[0]

    def _watch(self) -> None:
        self._runtime.bind(self._device)  # else CUDA creates a context on device 0 for this thread
        while (head := self._next()) is not None:
            try:
                if self._runtime.query(head.done):
                    with self._cond:
                        self._outstanding.popleft()
                    self._write(head)
                    continue
                error = self._backend.async_error()
            except Exception as exc:  # a CUDA error surfaces here first
                error = f"{type(exc).__name__}: {exc}"
            if error is not None:
                self._fail(error)
                return
            time.sleep(POLL_INTERVAL)

    def _write(self, item: Outstanding) -> None:
        for row, phase, start, end in item.spans:
            self._timeline.span(row, phase, item.clock.ns(start), item.clock.ns(end))

    def _fail(self, error: str) -> None:
        self.peer_failed = getattr(self._backend, "peer_failed", lambda _: False)(error)
        self.error = f"GPU collectives failed: {error}"
        log.error("gradsync: %s: %s; aborting the NCCL communicators", self._label, self.error)
        try:
            self._backend.close(abort=True)
        finally:
            self._on_error()


class Timing:
    """Timing events recorded on a stream for the timeline; inert (None events) without one."""

    def __init__(self, runtime: Any, device: int, stream: Any) -> None:
        self._runtime, self._device, self._stream = runtime, device, stream
        self.start = self.mark()

    def mark(self) -> Any:
        if self._runtime is None:
            return None
        event = self._runtime.event(self._device, timing=True)
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
