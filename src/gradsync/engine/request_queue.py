"""The queue between the user's threads and a coordinator, and the registry of what is in flight.

Any thread may push entries (the ops, in the caller's thread); the thread running the
coordinator's cycle takes them. The queue also owns the registry of every collective in flight on
this rank (from push until the coordinator hands its result over), so that another thread can stop
gradsync without touching the coordinator's own state: :meth:`TensorQueue.close` (the liveness
watchdog's verdict, a failed coordinator) fails every handle in flight right here, under the
queue's lock, even while the coordinator thread is blocked in MPI for good.
"""

from __future__ import annotations

import contextvars
import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

from ..errors import GradsyncError
from ..handles import Handle
from .protocol import Request


@dataclasses.dataclass(eq=False, slots=True)  # slots: one is made per op, without an instance dict
class Entry:
    """A request together with this rank's memory for it.

    ``source`` is a numpy view of the input; ``target`` a numpy view of where the result goes (the
    same object for in-place ops; None where the coordinator allocates it, as for allgather).
    ``result`` is what the handle returns; ``allocate`` makes it (and ``target``) when needed: from
    the output shape (allgather), or from the output shape and the rows received from each rank
    (alltoall, whose result is the pair (output, received splits)).
    For a tensor in device memory, ``source`` and ``target`` are device arrays of the framework
    whose :class:`~gradsync.arrays.device.DeviceRuntime` is ``runtime``, on CUDA device ``device``;
    ``stream`` is the caller's current stream at submission and ``ready`` the event recorded on it.
    """

    request: Request
    handle: Handle
    source: Any
    target: Any
    result: Any
    allocate: Callable[..., tuple[Any, Any]] | None = None
    submitted_ns: int = dataclasses.field(default_factory=time.perf_counter_ns)
    runtime: Any = None  # a gradsync.arrays.device.DeviceRuntime
    device: int = -1
    ready: Any = None
    stream: Any = None


# True inside a blocking op (submission.blocking): its thread waits for what it pushes at once, so the
# push is urgent and the coordinator cycles without waiting to batch more requests.
WAITING: contextvars.ContextVar[bool] = contextvars.ContextVar("gradsync_waiting", default=False)

# True while a thread submits what it will wait for right away and, with caller runs, cycle for
# itself (a blocking torch.distributed call, gradsync.torch.distributed.work.waited_at_once): its push
# wakes no coordinator thread, so that the wait finds the coordinator idle. If the wait finds it
# busy, it hurries the queue as any wait does; a push nobody waits for is taken by the coordinator
# thread's next timed cycle.
QUIET: contextvars.ContextVar[bool] = contextvars.ContextVar("gradsync_quiet", default=False)

# What a stopped queue raises and fails its handles with: called with the message.
ErrorType = Callable[[str], GradsyncError]


class TensorQueue:
    """Thread-safe queue of entries, and registry of the collectives in flight (see the module doc).

    ``world_rank`` is this process's world rank, which error messages name.
    """

    def __init__(self, world_rank: int) -> None:
        self.world_rank = world_rank
        # Every method takes ``_lock`` directly (``with self._lock``): the same lock as the
        # condition's, without Condition.__enter__/__exit__, two Python calls per use on every op.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._new: list[Entry] = []
        self._in_flight: dict[str, Entry] = {}
        self._shutdown = False
        self._interrupted = False
        self._urgent = False  # a thread waits for something queued (see hurry)
        self._batching = False  # the coordinator waits for the cycle time to pass (see wait)
        self.wakes = 0  # how often wake() was called: a wait that saw an older count returns at once
        self.closed_error: BaseException | None = None
        #: Whether :meth:`close` was called (``closed_error`` is then set): a plain attribute, read
        #: several times per cycle and between the tests of every MPI wait that can be left.
        self.closed = False
        self.failure: str | None = None  # why gradsync stopped, when MPI can no longer finish cleanly

    def push(self, entry: Entry) -> None:
        """Queue ``entry`` and wake the coordinator.

        Raises:
            ValueError: a collective of the same name is still in flight on this rank.
            GradsyncError: the coordinator has stopped (the error says why).
        """
        self.push_all([entry])

    def push_all(self, entries: list[Entry], wake: bool = True) -> None:
        """Queue every entry of ``entries`` at once (a group), or none of them; as :meth:`push`.
        ``wake=False``: do not wake the coordinator's thread (the caller runs the cycle itself);
        nor inside :data:`QUIET`.
        Inside a blocking op (:data:`WAITING`) the push is urgent, as after :meth:`hurry`."""
        with self._lock:
            for entry in entries:
                self._check_free(entry)
            in_flight = self._in_flight
            for entry in entries:
                in_flight[entry.request.name] = entry
            self._new.extend(entries)
            if WAITING.get():
                self._urgent = True
            if wake and (self._urgent or not self._batching) and not QUIET.get():
                # (a batching wait ends on its own; a quiet push is waited for by its thread)
                self._cond.notify()

    def hurry(self) -> None:
        """A thread is about to wait for a collective in flight: the coordinator's next cycle is
        due at once, not after the cycle time that batches asynchronous requests."""
        if self._urgent:  # already hurried, and not yet taken (take() clears it under the lock):
            return  # do not contend for the lock with the coordinator that was just woken
        with self._lock:
            if not self._urgent:
                self._urgent = True
                self._cond.notify()

    def _check_free(self, entry: Entry) -> None:
        if self.closed_error is not None:
            raise self.closed_error
        name = entry.request.name
        if name in self._in_flight:
            raise ValueError(f"gradsync: rank {self.world_rank}: a collective named {name!r} is "
                             "still in flight; wait for its handle before reusing the name, or give "
                             "the second collective a name of its own (two DistributedOptimizers "
                             "without named_parameters over parameters of the same shapes name "
                             "theirs alike: pass named_parameters=)")

    def request_shutdown(self) -> None:
        with self._lock:
            self._shutdown = True
            self._cond.notify()

    def interrupt(self) -> None:
        """Wake the coordinator from another thread (the device watchdog found an error)."""
        with self._lock:
            self._interrupted = True
            self._cond.notify()

    def has_work(self) -> bool:
        """Whether a cycle has something to do: new entries, shutdown asked for, :meth:`interrupt`
        or :meth:`close` called."""
        with self._lock:
            return bool(self._new or self._shutdown or self._interrupted or self.closed_error)

    def pressing(self) -> bool:
        """Whether a cycle is due at once, without batching: a thread waits (:meth:`hurry`, a
        blocking op's push), shutdown asked for, :meth:`interrupt` or :meth:`close` called."""
        with self._lock:
            return bool(self._urgent or self._shutdown or self._interrupted or self.closed_error)

    def wake(self) -> None:
        """Wake the coordinator's thread so that it looks again (a caller ran cycles meanwhile)."""
        with self._lock:
            self.wakes += 1
            self._cond.notify()

    def wait(self, timeout: float | None, wakes: int | None = None, batching: bool = False) -> None:
        """Block until there are new entries, shutdown was asked for, :meth:`interrupt`,
        :meth:`close`, :meth:`hurry` or :meth:`wake` was called (or had been, since :attr:`wakes`
        was ``wakes``), or ``timeout`` seconds passed (None: no limit). ``batching``: new entries
        do not end the wait (the coordinator lets more arrive until ``timeout``) unless a thread
        waits for one (:meth:`hurry`); the rest do. An urgent flag without new entries (a thread
        waits for a request already negotiated, pending on other ranks) ends no wait."""
        with self._lock:
            if not ((self._new and (self._urgent or not batching))
                    or self._shutdown or self._interrupted or self.closed_error
                    or (wakes is not None and wakes != self.wakes)):
                self._batching = batching
                try:
                    self._cond.wait(timeout)
                finally:
                    self._batching = False

    def take(self) -> tuple[list[Entry], bool]:
        """The entries queued since the last call, and whether shutdown was asked for."""
        with self._lock:
            entries, self._new = self._new, []
            self._interrupted = self._urgent = False
            return entries, self._shutdown

    def finished(self, names: list[str]) -> None:
        """The collectives ``names`` are done with (their names may be reused)."""
        with self._lock:
            for name in names:
                self._in_flight.pop(name, None)

    def handles_named(self, name: str) -> list[Handle]:
        """A snapshot of the handles in flight named ``name`` or ``name.<member>`` (a group's
        members, a front door's per-tensor names): what a caller that reuses ``name`` waits for."""
        if not self._in_flight:  # nothing in flight (a blocking caller's loop): no lock, no scan
            return []
        prefix = name + "."
        with self._lock:
            return [entry.handle for key, entry in self._in_flight.items()
                    if key == name or key.startswith(prefix)]

    def pending_names(self) -> list[str]:
        """A snapshot of the names in flight (for the stall reports of other process sets)."""
        with self._lock:
            return list(self._in_flight)

    def close(self, error_type: ErrorType, reason: str, cause: BaseException | None = None,
              failure: bool = False) -> bool:
        """Stop: refuse further entries, fail every collective in flight, wake the coordinator.

        Each handle fails with ``error_type`` and a message naming its tensor and ``reason``; later
        pushes raise "gradsync has stopped: <reason>". ``failure``: MPI cannot finish cleanly any
        more (a rank was lost, the coordinator failed), recorded in :attr:`failure`. Callable from
        any thread; only the first call has an effect (returns False for later ones).
        """
        with self._lock:
            if self.closed_error is not None:
                return False
            closed = error_type(f"gradsync: rank {self.world_rank}: gradsync has stopped: {reason}")
            closed.__cause__ = cause
            self.closed_error = closed
            self.closed = True
            self.failure = reason if failure else None
            entries, self._new = list(self._in_flight.values()), []
            self._in_flight.clear()
            self._cond.notify()
        for entry in entries:
            request = entry.request
            error = error_type(f"gradsync: rank {self.world_rank}: {request.kind.name.lower()} "
                               f"{request.name!r} did not complete: {reason}")
            error.__cause__ = cause
            entry.handle.fail(error)
        return True
