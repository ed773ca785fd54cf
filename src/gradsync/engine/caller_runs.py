"""Caller runs: a thread waiting for a host handle runs the coordinator's cycles itself.

:class:`CallerRuns` is an object the coordinator holds (:mod:`gradsync.engine.coordinator`, whose module
docstring says when a caller may run cycles and why the result is the same whichever thread runs
them), given what it needs explicitly: the coordinator's lock, its collaborators (queue, pending
entries, device executor: :class:`gradsync.engine.parts.CycleParts`), its cycle and crash handler.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from ..handles import Handle
from .parts import CycleParts


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
    """

    def __init__(self, parts: CycleParts, *, lock: threading.Lock, cycle: Callable[[], bool],
                 crashed: Callable[[BaseException], None], enabled: bool) -> None:
        self.enabled = enabled
        self._lock, self._queue, self._pending, self._device = lock, parts.queue, parts.pending, parts.device
        self._cycle, self._crashed = cycle, crashed
        self._turn: int | None = None  # the thread ident of a caller running cycles (holds lock)

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

    def run_for(self, handle: Handle) -> None:
        """Caller runs: from the thread about to wait for ``handle``, run cycles until it is done,
        if this thread holds the lock in its turn (:meth:`caller_turn`) or takes it now (the
        background thread is idle), and this set has moved no GPU tensor (device work stays on the
        background thread, whose GPU binding and streams it is); else return at once and let the
        caller wait on the handle's event. Never raises: a failed cycle fails the handles, as on
        the background thread, and the background thread then stops."""
        if self._turn == threading.get_ident():
            self._cycle_until(handle)
            return
        if self._device.device is not None or not self._lock.acquire(blocking=False):
            return
        self._turn = threading.get_ident()
        try:
            self._cycle_until(handle)
        finally:
            self.end_turn()

    def _cycle_until(self, handle: Handle) -> None:
        while not handle.done() and self._device.device is None:
            if not self._guarded_cycle():
                return

    def _guarded_cycle(self) -> bool:
        """The cycle in a caller's thread: an exception is handled as the background thread's."""
        try:
            return self._cycle()
        except BaseException as exc:  # noqa: BLE001 - it fails every handle, as on the background thread
            self._crashed(exc)
            return False
