"""torch ``Work`` objects whose futures complete from a gradsync thread.

torch's C++ callers (DDP's reducer in an autograd thread, ``Work.wait()``) hold a
``torch.futures.Future`` and chain callbacks on it. A :class:`Completer` owns one daemon thread per
process group: it waits for the gradsync handles of each call in submission order and runs the
call's *finish* (copy results into torch's output tensors). It then hands the future to
:class:`Callbacks`, whose threads complete it: the future's callbacks run there, never in the
thread that submitted the collective, and never in the completer's, because a callback may block
on another collective of the group (PowerSGD's hook waits inside its ``then``), which only the
completer thread can finish.

A failed call must fail its future where C++ sees it too. ``Future.set_exception`` from Python
does not: it stores the exception as the future's *value* (only Python's ``wait()`` raises it),
so DDP's reducer would read an exception object as its bucket (and crash). So the Work's future
is the ``then`` of an *outcome* future that gets (outputs, error): the ``then`` raises the error,
which torch turns into a real error of the Work's future (a RuntimeError naming it, for C++
callers and chained futures), and :meth:`FutureWork.wait` raises the original exception itself.
"""

from __future__ import annotations

import datetime
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

#: What a call waits for: gradsync handles (``.wait()``) or deferred blocking calls (no argument).
Pending = Any
#: Turns the handles' results (in the order of the pending list) into the future's value.
Finish = Callable[[list[Any]], list[torch.Tensor]]


class FutureWork(dist.Work):
    """A torch ``Work`` on a future. Unlike torch's ``_create_work_from_future``, whose ``wait()``
    returns True even when the future failed, :meth:`wait` raises the collective's error.

    ``outcome``: the future of (outputs, error) that ``future`` follows (see the module), whose
    error :meth:`wait` raises as it is (gradsync's CollectiveError, StallError, ...).
    """

    def __init__(self, future: torch.futures.Future, source: Callable[[], int] | None = None,
                 outcome: torch.futures.Future | None = None) -> None:
        super().__init__()
        self._future = future
        self._source = source
        self._outcome = outcome

    def wait(self, timeout: datetime.timedelta | float | None = None) -> bool:
        """Block until the collective finished; raise its error (gradsync's CollectiveError,
        StallError, RankFailureError, ...).

        Raises:
            TimeoutError: a finite, positive ``timeout`` (a timedelta or seconds) passed first.
        """
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
        if seconds is not None and seconds > 0 and not self._future.done():
            finished = threading.Event()
            self._future.add_done_callback(lambda _: finished.set())
            if not finished.wait(seconds):
                raise TimeoutError(f"gradsync: the collective did not finish within {seconds} s")
        try:
            self._future.wait()
        except RuntimeError:
            error = None if self._outcome is None else self._outcome.value()[1]
            if error is None:
                raise
            raise error from None
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()

    def _source_rank(self) -> int:
        """The sender of a receive (``dist.recv`` from any source), once it completed."""
        if self._source is None:
            raise RuntimeError("gradsync: only a receive's Work has a source rank")
        self.wait()
        return self._source()


def _wait(pending: Pending) -> Any:
    """The result of one pending item: a handle's output, or a deferred call's return value."""
    return pending.wait() if hasattr(pending, "wait") else pending()


def _outputs_or_raise(outcome: torch.futures.Future) -> list[torch.Tensor]:
    """The Work's future's value: the outcome's outputs, or its error raised (see the module)."""
    outputs, error = outcome.value()
    if error is not None:
        raise error
    return outputs


class Callbacks:
    """Daemon threads that complete futures (and so run their callbacks): one more whenever every
    thread is busy, so a callback that blocks on a later future never holds that future back."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = 0
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def complete(self, future: torch.futures.Future, outputs: Any, error: BaseException | None) -> None:
        """Set the outcome ``future``'s result, (``outputs``, ``error``), in a callback thread."""
        with self._lock:
            if self._idle == 0:
                thread = threading.Thread(target=self._run, daemon=True,
                                          name=f"gradsync-torch-{self._name}-callbacks{len(self._threads)}")
                self._threads.append(thread)
                thread.start()
            else:
                self._idle -= 1
        self._queue.put((future, outputs, error))

    def close(self) -> None:
        """End every thread once the futures handed over so far are complete."""
        with self._lock:
            threads, self._threads = self._threads, []
        for _ in threads:
            self._queue.put(None)
        for thread in threads:
            thread.join()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            future, outputs, error = item
            future.set_result((outputs, error))
            with self._lock:
                self._idle += 1


class Completer:
    """One process group's completion thread (started on the first call, stopped by :meth:`close`)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._callbacks = Callbacks(name)

    def work(self, pending: Sequence[Pending], finish: Finish,
             source: Callable[[], int] | None = None) -> FutureWork:
        """A torch ``Work`` whose future gets ``finish(results of pending)`` (or its error);
        ``source``: a receive's sender, for :meth:`FutureWork._source_rank`."""
        outcome: torch.futures.Future = torch.futures.Future()
        self._start()
        self._queue.put((list(pending), finish, outcome))
        return FutureWork(outcome.then(_outputs_or_raise), source, outcome)

    def done(self, outputs: list[torch.Tensor]) -> FutureWork:
        """A ``Work`` already complete with ``outputs`` (a call that moves nothing)."""
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(outputs)
        return FutureWork(future)

    def close(self) -> None:
        """Let the thread finish the calls queued so far, then end (and the callback threads)."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join()
        self._callbacks.close()

    def _start(self) -> None:
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, daemon=True,
                                                    name=f"gradsync-torch-{self._name}")
                    self._thread.start()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            pending, finish, future = item
            try:
                results = [_wait(p) for p in pending]
                # As torch's C++ backends write results, outside autograd and whatever mode the
                # caller's thread is in: outputs made under torch.inference_mode() (Lightning's
                # validation loop) are inference tensors, which only inference mode may write.
                with torch.inference_mode():
                    outputs = finish(results)
            except BaseException as error:  # noqa: BLE001 - every failure belongs to the caller
                self._callbacks.complete(future, None, error)
            else:
                self._callbacks.complete(future, outputs, None)
