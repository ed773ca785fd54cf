"""Handles: the caller's side of an asynchronous collective."""

from __future__ import annotations

import _thread
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

_COMPLETING = threading.Lock()
log = logging.getLogger("gradsync")


class Handle:
    """The pending result of one asynchronous collective (returned by the ``*_async`` ops).

    Wait with :func:`gradsync.synchronize` (or :meth:`wait`), test with :func:`gradsync.poll`.
    A handle completes exactly once, with a result or with an exception.

    A collective of device tensors completes when its work is *enqueued* on gradsync's CUDA stream;
    the handle then carries the event recorded after that work (``completion``), and :meth:`wait`
    makes the caller's current stream wait on it: kernels the caller enqueues afterwards see the
    result, and the host does not block.
    """

    __slots__ = ("name", "_done", "_gate", "_result", "_error", "_completion", "_runner", "_hurry",
                 "waited", "divisor", "_callbacks")

    def __init__(self, name: str) -> None:
        self.name = name
        # Completion: ``_done`` says it, ``_gate`` (a lock held from here until completion) is what
        # waiters block on. A bare lock costs a fraction of a threading.Event (a Condition and a
        # lock per waiter), a cost every op would pay (docs/benchmarks.md, per-op cost).
        self._done = False
        self._gate = _thread.allocate_lock()
        self._gate.acquire()
        self._result: Any = None
        self._error: BaseException | None = None
        self._completion: tuple[Any, int, Any] | None = None  # (device runtime, device, done event)
        # What a wait for it unfinished does first (set by its coordinator, see on_wait).
        self._runner: Callable[[Handle, float | None], None] | None = None
        self._hurry: Callable[[], None] | None = None
        #: True once a thread has waited for it unfinished (set by :meth:`wait`): while it waits on
        #: other ranks, its coordinator negotiates again at once rather than after the cycle time.
        self.waited = False
        #: Once done: the Average divisor the coordinator decided for this collective (the set's
        #: size, or with ``GRADSYNC_JOIN_DIVISOR=contributors`` the ranks that had not joined;
        #: the same on every rank), for a framework layer that finishes an Average itself (the
        #: sparse gradients' allgather, Horovod's integer scaling). 0 until then.
        self.divisor = 0
        self._callbacks: list[Callable[[Handle], None]] | None = None

    def done(self) -> bool:
        """True once the collective has finished, successfully or not; never blocks."""
        return self._done

    def on_wait(self, hurry: Callable[[], None],
                runner: Callable[[Handle, float | None], None] | None = None) -> None:
        """What a wait for this handle, unfinished, does before it blocks; set by the coordinator
        when the collective is submitted.

        Args:
            hurry: tells the coordinator's queue that a thread waits (its next cycle is due at
                once, without batching); called by every wait, after which :attr:`waited` is True.
            runner: with caller runs, ``runner(handle, deadline)`` runs the coordinator's cycles
                in the waiting thread if the coordinator is idle, leaving them at ``deadline``
                (a ``time.monotonic()``, None for a wait without timeout)
                (:meth:`gradsync.engine.caller_runs.CallerRuns.run_for`); called by every wait.
                None: the coordinator's thread runs them.
        """
        self._hurry = hurry
        self._runner = runner

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the collective finishes and return its output tensor.

        For device tensors this returns once the collective is enqueued, after making the caller's
        current CUDA stream wait for it (cudaStreamWaitEvent; the host does not wait for the GPU).
        With caller runs (``GRADSYNC_CALLER_RUNS``), a host collective that has not run yet is
        negotiated and run in this thread if the coordinator thread is idle (until ``timeout``:
        then the coordinator thread takes over, and this thread waits no longer).

        Args:
            timeout: seconds to wait at most; ``None`` waits until it finishes.

        Raises:
            TimeoutError: ``timeout`` passed first (the collective stays pending).
            gradsync.CollectiveError, gradsync.ShutdownError: the collective failed; the message
                names the tensor and the rank.
            gradsync.RankFailureError: another rank was lost (died, hung, or its coordinator
                failed); the message names it.
        """
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        if self._runner is not None and not self._done:
            self._runner(self, deadline)
        if self._hurry is not None and not self._done:
            self.waited = True
            self._hurry()
        if not self._done and not self._pass_gate(None if deadline is None else deadline - time.monotonic()):
            raise TimeoutError(f"gradsync: collective {self.name!r} did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        if self._completion is not None:
            runtime, device, done = self._completion
            runtime.wait(runtime.current_stream(device), done)
        return self._result

    def _pass_gate(self, timeout: float | None) -> bool:
        """Block until completion (True) or ``timeout`` seconds (False); each waiter takes the
        released gate and hands it straight back, so any number of threads may wait."""
        if self._gate.acquire(True, -1 if timeout is None else max(0.0, timeout)):
            self._gate.release()
            return True
        return self._done

    def add_done_callback(self, callback: Callable[[Handle], None]) -> None:
        """Call ``callback(handle)`` once the collective has finished, successfully or not (then
        :meth:`wait` no longer blocks); at once, in this thread, if it already has. Otherwise it
        runs in the thread that completes the handle (gradsync's coordinator thread, or the
        watchdog's when a rank is lost): it must be quick, must not block and must not wait for
        another collective. An exception it raises is logged and dropped. Same contract as
        ``concurrent.futures.Future.add_done_callback``."""
        with _COMPLETING:
            if not self._done:
                self._callbacks = [*(self._callbacks or ()), callback]
                return
        _call_back(callback, self)

    def complete(self, result: Any, completion: tuple[Any, int, Any] | None = None,
                 divisor: int = 0) -> None:
        """Finish with ``result`` (what :meth:`wait` returns), unless already finished: the first
        completion or failure wins (the watchdog may fail a handle while its collective completes).

        Args:
            completion: for device tensors, (device runtime, device, event recorded after the
                collective's work), which :meth:`wait` makes the caller's stream wait on.
            divisor: the Average divisor the coordinator decided (:attr:`divisor`).
        """
        with _COMPLETING:  # the first completion wins: the watchdog may fail a handle concurrently
            if self._done:
                return
            self._result = result
            self._completion = completion
            self.divisor = divisor
            self._done = True
            self._gate.release()
        if self._callbacks is not None:  # (no call at all for the usual handle without callbacks)
            self._run_callbacks()

    def fail(self, error: BaseException) -> None:
        """Finish with ``error`` (what :meth:`wait` raises), unless already finished (as
        :meth:`complete`)."""
        with _COMPLETING:
            if self._done:
                return
            self._error = error
            self._done = True
            self._gate.release()
        self._run_callbacks()

    def _run_callbacks(self) -> None:
        """After completion (the callbacks list no longer changes: add_done_callback sees done)."""
        callbacks, self._callbacks = self._callbacks, None
        for callback in callbacks or ():
            _call_back(callback, self)

    def __repr__(self) -> str:
        state = "failed" if self._error else ("done" if self.done() else "pending")
        return f"<gradsync.Handle {self.name!r} {state}>"


class GroupHandle:
    """The pending results of a grouped collective (returned by the ``grouped_*_async`` ops).

    Its members were negotiated and executed as one unit, so they complete together. Wait with
    :func:`gradsync.synchronize` (or :meth:`wait`), which returns the list of outputs in the order
    of the input tensors; test with :func:`gradsync.poll`.
    """

    __slots__ = ("name", "handles")

    def __init__(self, name: str, handles: list[Handle]) -> None:
        self.name = name
        self.handles = handles

    def done(self) -> bool:
        """True once every member has finished, successfully or not; never blocks."""
        return all(handle.done() for handle in self.handles)

    @property
    def divisor(self) -> int:
        """:attr:`Handle.divisor` of the group (its members ran as one collective)."""
        return self.handles[0].divisor

    def add_done_callback(self, callback: Callable[[GroupHandle], None]) -> None:
        """Call ``callback(group_handle)`` once every member has finished; as
        :meth:`Handle.add_done_callback` (it runs in the thread that completes the last member)."""
        left = [len(self.handles)]
        lock = threading.Lock()

        def one_done(_: Handle) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                callback(self)

        if not self.handles:
            _call_back(callback, self)
        for handle in self.handles:
            handle.add_done_callback(one_done)

    def wait(self, timeout: float | None = None) -> list[Any]:
        """Block until every member finished; return their outputs, in the order of the inputs.

        Raises the first failed member's error (a group fails as a whole, with one message), or
        TimeoutError as :meth:`Handle.wait` (``timeout`` applies to each member in turn).
        """
        return [handle.wait(timeout) for handle in self.handles]

    def __repr__(self) -> str:
        return f"<gradsync.GroupHandle {self.name!r} of {len(self.handles)}>"


def _call_back(callback: Callable[[Any], None], handle: Any) -> None:
    try:
        callback(handle)
    except Exception:  # noqa: BLE001 - a callback's failure must not fail the thread completing it
        log.exception("gradsync: a done callback of %r raised", handle)
