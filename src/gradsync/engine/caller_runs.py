"""Caller runs: a thread waiting for a host handle runs the coordinator's cycles itself.

:class:`CallerRuns` is an object the coordinator holds (:mod:`gradsync.engine.coordinator`, whose module
docstring says when a caller may run cycles and why the result is the same whichever thread runs
them), given what it needs explicitly: the coordinator's lock, its collaborators (queue, pending
entries, device executor: :class:`gradsync.engine.parts.CycleParts`), its cycle and crash handler.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator

from ..handles import Handle
from .parts import CycleParts
from .waiting import CALLER_PATIENCE_SECONDS, LeftTurn, wait_or_leave


class CallerRuns:
    """The caller's turn at a coordinator's lock (``GRADSYNC_CALLER_RUNS``).

    Args:
        parts: the coordinator's collaborators, of which it uses: the queue (woken when a turn ends
            with requests left), the pending entries (read: whether requests are left), and the
            device executor (once it has a device, ``device.device``, device work stays on the
            background thread, and callers run no cycle).
        lock: the coordinator's lock, held by whichever thread runs a cycle.
        cycle: the coordinator's cycle (False once it stopped); ``crashed(exc)``: its handler of a
            cycle that raised.
        enabled: whether callers may run cycles at all (off: every method but :meth:`mine` does
            nothing, and a waiter waits on its handle); settable.
        guarded: rank failure detection is on: a caller's MPI waits must be able to stop when the
            watchdog's verdict comes (:meth:`waiter`), which a blocking MPI call cannot.

    A caller that waits with a deadline (``Handle.wait(timeout)``), or any caller when ``guarded``,
    waits for the other ranks through :func:`gradsync.engine.waiting.wait_or_leave` (:meth:`waiter`):
    at its deadline, once gradsync has stopped, or when the other ranks have not joined its
    negotiation within a short spin, it leaves its turn (the coordinator parks the rest of the
    cycle for the background thread, :meth:`gradsync.engine.coordinator.Coordinator.cycle`) and
    waits on its handle as any waiter does.
    """

    def __init__(self, parts: CycleParts, *, lock: threading.Lock, cycle: Callable[[], bool],
                 crashed: Callable[[BaseException], None], enabled: bool, guarded: bool = False) -> None:
        self.enabled, self.guarded = enabled, guarded
        self._lock, self._queue, self._pending, self._device = lock, parts.queue, parts.pending, parts.device
        self._cycle, self._crashed = cycle, crashed
        self._turn: int | None = None  # the thread ident of a caller running cycles (holds lock)
        self._leave_at: float | None = None  # the turn's deadline (time.monotonic()), if any
        self._negotiation_wait = functools.partial(wait_or_leave, leave=self._deadline_or_stop,
                                                   patience=CALLER_PATIENCE_SECONDS)
        self._data_wait = functools.partial(wait_or_leave, leave=self._stopped)

    def mine(self) -> bool:
        """Whether the calling thread holds its turn now."""
        return self._turn == threading.get_ident()

    @contextlib.contextmanager
    def caller_turn(self) -> Iterator[None]:
        """Around a blocking op's submission and wait (ops.py): with caller runs, if the background
        thread is idle, this thread takes the lock first, so that the push wakes nobody and
        :meth:`run_for` cycles here at once. Otherwise (lock taken, caller runs off, a GPU set) it
        does nothing and the op waits as an asynchronous one would."""
        taken = self.take_turn()
        try:
            yield
        finally:
            if taken:
                self.finish_turn()

    def take_turn(self) -> bool:
        """:meth:`caller_turn`'s start, for callers that cannot afford a generator per op
        (:class:`gradsync.engine.submission.blocking`): True if this thread now holds its turn; then call
        :meth:`finish_turn` afterwards, whatever happens."""
        if (not self.enabled or self._device.device is not None
                or not self._lock.acquire(blocking=False)):
            return False
        self._turn = threading.get_ident()
        return True

    def finish_turn(self) -> None:
        """:meth:`caller_turn`'s end after :meth:`take_turn` returned True: release the lock unless
        the turn already ended (a device entry handed the cycle to the background thread)."""
        if self._turn == threading.get_ident():
            self.end_turn()

    def end_turn(self) -> None:
        """End a caller's turn. Requests left waiting for other ranks need the background thread's
        next cycle, whose wait was timed before them: wake it (else it sleeps on, as it should)."""
        left = bool(self._pending)
        self._turn = None
        self._lock.release()
        if left:
            self._queue.wake()

    def run_for(self, handle: Handle, deadline: float | None = None) -> None:
        """Caller runs: from the thread about to wait for ``handle``, run cycles until it is done,
        if this thread holds the lock in its turn (:meth:`caller_turn`) or takes it now (the
        background thread is idle), and this set has moved no GPU tensor (device work stays on the
        background thread, whose GPU binding and streams it is); else return at once and let the
        caller wait on the handle's event. ``deadline`` (a ``time.monotonic()``): leave the turn
        then (:meth:`waiter`). Never raises: a failed cycle fails the handles, as on the background
        thread, and the background thread then stops."""
        if self._turn == threading.get_ident():
            self._cycle_until(handle, deadline)
            return
        if self._device.device is not None or not self._lock.acquire(blocking=False):
            return
        self._turn = threading.get_ident()
        try:
            self._cycle_until(handle, deadline)
        finally:
            self.finish_turn()

    def waiter(self, data: bool = False) -> Callable | None:
        """How the thread running a cycle waits for an MPI request: None (the background thread,
        or a caller with no deadline and rank failure detection off: the blocking MPI calls), else
        :func:`~gradsync.engine.waiting.wait_or_leave`, which leaves the turn once gradsync has
        stopped and, for a negotiation (not ``data``: a data collective starts only once every rank
        is there), at the caller's deadline or after spinning
        :data:`~gradsync.engine.waiting.CALLER_PATIENCE_SECONDS` (then the coordinator thread,
        waiting inside MPI, takes over: a step's last gradients arriving a few ms apart on the
        ranks cost no sleep granularity)."""
        if self._turn != threading.get_ident() or not (self.guarded or self._leave_at is not None):
            return None
        return self._data_wait if data else self._negotiation_wait

    def _deadline_or_stop(self) -> bool:
        return self._queue.closed or (self._leave_at is not None and time.monotonic() >= self._leave_at)

    def _stopped(self) -> bool:
        return self._queue.closed

    def _cycle_until(self, handle: Handle, deadline: float | None) -> None:
        self._leave_at = deadline
        try:
            while not handle.done() and self._device.device is None:
                if not self._guarded_cycle():
                    return
        finally:
            self._leave_at = None

    def _guarded_cycle(self) -> bool:
        """The cycle in a caller's thread: an exception is handled as the background thread's;
        False (cycle no more) when the caller left its turn (:class:`LeftTurn`)."""
        try:
            return self._cycle()
        except LeftTurn:  # the coordinator parked the rest of the cycle: let its thread have it
            self.end_turn()
            return False
        except BaseException as exc:  # noqa: BLE001 - it fails every handle, as on the background thread
            self._crashed(exc)
            return False
