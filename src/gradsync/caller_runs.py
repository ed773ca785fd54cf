"""Caller runs: a thread waiting for a host handle runs the coordinator's cycles itself.

Part of :class:`gradsync.coordinator.Coordinator` (a mixin; the module docstring there says when
a caller may run cycles and why the result is the same whichever thread runs them).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from .handles import Handle


class CallerRuns:
    """The caller's turn at a coordinator's lock (``GRADSYNC_CALLER_RUNS``)."""

    @contextlib.contextmanager
    def caller_turn(self) -> Iterator[None]:
        """Around a blocking op's submission and wait (ops.py): with caller runs, if the background
        thread is idle, this thread takes :attr:`lock` first, so that the push wakes nobody and
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
        (:class:`gradsync.ops.blocking`): True if this thread now holds its turn; then call
        :meth:`finish_turn` afterwards, whatever happens."""
        if (not self.caller_runs or self.device.device is not None
                or not self.lock.acquire(blocking=False)):
            return False
        self._turn = threading.get_ident()
        return True

    def finish_turn(self) -> None:
        """:meth:`caller_turn`'s end after :meth:`take_turn` returned True: release the lock unless
        the turn already ended (a device entry handed the cycle to the background thread)."""
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
