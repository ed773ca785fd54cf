"""torch ``Work`` objects whose futures complete from gradsync's threads, or from the waiter's.

torch's C++ callers (DDP's reducer in an autograd thread, ``Work.wait()``) hold a
``torch.futures.Future`` and chain callbacks on it. Each call of the process group is a
:class:`_Call`: its pending gradsync handles (or deferred blocking calls), its *finish* (copy the
results into torch's output tensors) and its future. Whoever takes the call first finishes it and
completes the future, exactly once:

* a thread that waits for it (``work.wait()``, which a blocking ``dist.all_reduce`` calls right
  after submitting): it waits for the handles itself, finishes, and completes the future in its own
  thread, with no hand-off to another thread and back;
* otherwise, once its last handle completes (a done callback, in gradsync's coordinator thread),
  one of the :class:`Callbacks` threads: the future's callbacks run there, never in the
  coordinator's thread, and never where a callback that blocks on another collective of the group
  (PowerSGD's hook waits inside its ``then``) could hold that collective back.

Calls whose pending items are deferred blocking calls (a barrier ordered after the group's earlier
calls, the waits of ``send``/``recv``) are run in order by the :class:`Completer`'s own thread.

A failed call must fail its future where C++ sees it too. ``Future.set_exception`` from Python
does not: it stores the exception as the future's *value* (only Python's ``wait()`` raises it),
so DDP's reducer would read an exception object as its bucket (and crash). So the Work's future
is the ``then`` of an *outcome* future that gets (outputs, error): the ``then`` raises the error,
which torch turns into a real error of the Work's future (a RuntimeError naming it, for C++
callers and chained futures), and :meth:`FutureWork.wait` raises the original exception itself.

A group's ``timeout`` (and ``barrier``'s own) gives each call a deadline: :class:`Deadlines`
fails the future of a call still unsettled then (first settle wins, :meth:`_Call.settle`), and a
waiter finishing a call itself waits for its handles until then only. The gradsync collective
stays pending; if it completes later, its results are not copied out.

torch before 2.13 keeps no reference to the Python object of a ``Work`` it got from a Python
process group: once Python drops it, a C++ caller's ``wait()`` (DDP's parameter check) reaches the
C++ base class and blocks for good. There the completer keeps each Work alive until its future
completes and the most recent ones after that (:data:`KEEP_ALIVE`).
"""

from __future__ import annotations

import collections
import datetime
import heapq
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ...engine.request_queue import QUIET
from ...handles import GroupHandle

#: What a call waits for: gradsync handles (``.wait()``) or deferred blocking calls (no argument).
Pending = Any
#: Turns the handles' results (in the order of the pending list) into the future's value.
Finish = Callable[[list[Any]], list[torch.Tensor]]


class WaitTimeout(dist.DistBackendError, TimeoutError):
    """``Work.wait(timeout)`` ran out: a ``torch.distributed.DistBackendError`` (a RuntimeError, as
    gloo's "Operation timed out!" is, so ``except RuntimeError`` written for gloo catches it) and a
    ``TimeoutError``. The collective stays pending: a later ``wait()`` still completes it."""


#: How many completed Works stay referenced on torch < 2.13 (see the module docstring); 0 elsewhere.
KEEP_ALIVE = 256 if tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13) else 0


class _Call:
    """One call of the process group in flight; :meth:`take` says who finishes it, :meth:`settle`
    who completes its future (see the module)."""

    __slots__ = ("pending", "finish", "outcome", "future", "deferred", "deadline", "what", "settled",
                 "_taken", "_lock")

    def __init__(self, pending: Sequence[Pending], finish: Finish, deadline: float | None = None,
                 what: str = "") -> None:
        self.pending = list(pending)
        self.finish = finish
        self.outcome: torch.futures.Future = torch.futures.Future()  # (outputs, error)
        self.future = self.outcome.then(_outputs_or_raise)  # the Work's (see the module)
        self.deferred = not all(hasattr(p, "add_done_callback") for p in self.pending)
        self.deadline = deadline  # time.monotonic() after which it fails (the group's timeout)
        self.what = what  # names the call in a timeout's error ("": its first handle's name)
        self.settled = False
        self._taken = False
        self._lock = threading.Lock()

    def take(self) -> bool:
        """True for the first thread that asks: it must then call :meth:`run`."""
        with self._lock:
            taken, self._taken = self._taken, True
        return not taken

    def settle(self, outcome: tuple[Any, BaseException | None]) -> None:
        """Complete the future with ``outcome`` unless it was completed already: the finish, or
        the group's timeout (:class:`Deadlines`), whichever comes first."""
        with self._lock:
            if self.settled:
                return
            self.settled = True
        self.outcome.set_result(outcome)

    def timed_out(self) -> BaseException:
        """The error of a call that outlived its deadline (torch's DistBackendError, a RuntimeError)."""
        return timed_out(self.what or next((p.name for p in self.pending if hasattr(p, "name")), "a call"))

    def outcome_of(self) -> tuple[Any, BaseException | None]:
        """Wait for every pending item (here, in the calling thread, until the deadline) and
        finish: (outputs, None), or (None, the error)."""
        try:
            try:
                results = [_wait(p, self.deadline) for p in self.pending]
            except TimeoutError:
                return None, self.timed_out()
            # As torch's C++ backends write results, outside autograd and whatever mode the
            # caller's thread is in: outputs made under torch.inference_mode() (Lightning's
            # validation loop) are inference tensors, which only inference mode may write.
            with torch.inference_mode():
                outputs = self.finish(results)
            _settle(outputs)
            return outputs, None
        except BaseException as error:  # noqa: BLE001 - every failure belongs to the caller
            return None, error

    def run(self) -> None:
        """:meth:`outcome_of`, then complete the futures in this thread (their callbacks run here);
        nothing once the call was settled by its timeout (its results are not written then)."""
        if not self.settled:
            self.settle(self.outcome_of())


def timed_out(what: str) -> BaseException:
    """The error of call ``what`` that outlived the group's timeout (torch's DistBackendError, a
    RuntimeError)."""
    error = getattr(dist, "DistBackendError", RuntimeError)
    return error(f"gradsync: {what}: Timed out after the process group's timeout: some rank "
                 "has not made this call (gradsync's stall report, GRADSYNC_STALL_CHECK_TIME_SECONDS, "
                 "names the ranks); the group's calls in flight are left pending")


def _outputs_or_raise(outcome: torch.futures.Future) -> list[torch.Tensor]:
    """The Work's future's value: the outcome's outputs, or its error raised (see the module)."""
    outputs, error = outcome.value()
    if error is not None:
        raise error
    return outputs


class FutureWork(dist.Work):
    """A torch ``Work`` on a future. Unlike torch's ``_create_work_from_future``, whose ``wait()``
    returns True even when the future failed, :meth:`wait` raises the collective's error."""

    def __init__(self, future: torch.futures.Future, source: Callable[[], int] | None = None,
                 call: _Call | None = None) -> None:
        super().__init__()
        self._future = future
        self._source = source
        self._call = call

    def wait(self, timeout: datetime.timedelta | float | None = None) -> bool:
        """Block until the collective finished; raise its error (gradsync's CollectiveError, ...).
        Without a timeout, a call no other thread has taken is finished in this thread.

        Raises:
            WaitTimeout: a finite, positive ``timeout`` (a timedelta or seconds) passed first (a
                DistBackendError and a TimeoutError; the collective stays pending).
        """
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
        bounded = seconds is not None and seconds > 0
        call = self._call
        if call is not None and not bounded and not call.deferred and call.take():
            call.run()
        if bounded and not self._future.done():
            finished = threading.Event()
            self._future.add_done_callback(lambda _: finished.set())
            if not finished.wait(seconds):
                from ...process import runtime

                raise WaitTimeout(f"gradsync: rank {runtime.rank()}: the collective did not finish "
                                  f"within {seconds} s (Work.wait's timeout; it stays pending)")
        try:
            self._future.wait()
        except RuntimeError:
            error = None if call is None else call.outcome.value()[1]
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


class _Finished(FutureWork):
    """The Work of a blocking call that was finished before it returned
    (:meth:`Completer.finished`): its future is complete, and :meth:`wait` returns at once."""

    def wait(self, timeout: datetime.timedelta | float | None = None) -> bool:
        return True


def _settle(outputs: Sequence[Any]) -> None:
    """Block this thread until the GPU work writing the CUDA tensors among ``outputs`` has run:
    the engine's collective (each handle's ``wait()`` made this thread's current stream wait for
    it) and the finish's copies, both on this thread's current stream of their device. A call's
    future then completes only once its CUDA results are in memory, so that any stream of any
    thread may read them (as with gloo's CUDA tensors; NCCL's futures instead carry CUDA events)."""
    devices = {t.device for t in outputs if isinstance(t, torch.Tensor) and t.is_cuda}
    for device in devices:
        torch.cuda.current_stream(device).synchronize()


def seconds(timeout: Any) -> float | None:
    """A torch timeout (a timedelta; negative or zero: unset) in seconds, or None."""
    if timeout is None:
        return None
    value = timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout)
    return value if value > 0 else None


_C10D = "torch.distributed.distributed_c10d"


class waited_at_once:  # noqa: N801 - used as a function, ``with waited_at_once(opts):``
    """Around a process-group method's submissions: if the ``torch.distributed`` function that
    called the method is blocking (``async_op=False``: it calls ``work.wait()`` as soon as the
    method returns), they are pushed without waking gradsync's coordinator thread
    (:data:`gradsync.engine.request_queue.QUIET`), so that the wait, in this thread, finds the
    coordinator idle and runs the cycle itself (caller runs): no hand-off to another thread and
    back (0.17 ms against 0.12 ms for a 4 KiB ``all_reduce`` on 2 ranks, docs/torch-distributed.md).
    Anything else (an ``async_op=True`` call, DDP's reducer, a caller not in torch.distributed)
    submits as usual. A class rather than a generator: every call enters one.

    Recent torch (2.13 here) says which in the method's options, ``opts.asyncOp`` (every
    collective of torch.distributed sets it to its ``async_op``; torch's C++ callers leave its
    default, True): one read. Older torch, or a method without options, says it only in the calling function's
    frame (:func:`_blocking_caller`), some microseconds more of a blocking call."""

    __slots__ = ("_opts", "_token")

    def __init__(self, opts: Any = None) -> None:
        self._opts = opts

    def __enter__(self) -> bool:
        """Whether the caller is blocking (then the call may finish before it returns,
        :meth:`Completer.finished`)."""
        async_op = getattr(self._opts, "asyncOp", None)
        blocking = async_op is False if async_op is not None else _blocking_caller(sys._getframe(2))
        self._token = QUIET.set(True) if blocking else None
        return blocking

    def __exit__(self, *exc_info: object) -> None:
        if self._token is not None:
            QUIET.reset(self._token)


def _blocking_caller(frame: Any) -> bool:
    """Whether one of the three frames from ``frame`` up is a ``torch.distributed`` function
    called with ``async_op=False`` (every collective there takes that argument)."""
    for _ in range(3):
        if frame is None:
            return False
        if frame.f_globals.get("__name__") == _C10D:
            return frame.f_locals.get("async_op") is False
        frame = frame.f_back
    return False


def _wait(pending: Pending, deadline: float | None = None) -> Any:
    """The result of one pending item: a handle's output (waited for until ``deadline``, a
    ``time.monotonic()``, then TimeoutError), or a deferred call's return value."""
    if not hasattr(pending, "wait"):
        return pending()
    if deadline is None:
        return pending.wait()
    return pending.wait(max(0.0, deadline - time.monotonic()))


class Deadlines:
    """The calls of one group that have a deadline, and a thread that fails each one still
    unsettled at its deadline (torch's process-group ``timeout``): started on the first call,
    sleeping on a condition until the earliest deadline. Settled calls are dropped lazily."""

    def __init__(self, name: str, expire: Callable[[_Call], None]) -> None:
        self._name = name
        self._expire = expire
        self._heap: list[tuple[float, int, _Call]] = []
        self._count = 0
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def add(self, call: _Call) -> None:
        with self._cond:
            self._count += 1
            if len(self._heap) >= 1024 and self._count % 1024 == 0:  # drop the settled ones
                self._heap = [item for item in self._heap if not item[2].settled]
                heapq.heapify(self._heap)
            heapq.heappush(self._heap, (call.deadline, self._count, call))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name=f"gradsync-torch-{self._name}-timeouts")
                self._thread.start()
            elif self._heap[0][2] is call:
                self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed:
                    while self._heap and self._heap[0][2].settled:
                        heapq.heappop(self._heap)
                    left = self._heap[0][0] - time.monotonic() if self._heap else None
                    if left is not None and left <= 0:
                        break
                    self._cond.wait(left)
                if self._closed:
                    return
                _, _, call = heapq.heappop(self._heap)
            self._expire(call)


class Callbacks:
    """Daemon threads that finish calls and complete their futures (and so run the futures'
    callbacks): one more whenever every thread is busy, so a callback that blocks on a later
    future never holds that future back."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = 0
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def run(self, job: Callable[[], None]) -> None:
        """Run ``job`` (finish a call, complete its future) in a callback thread; any thread."""
        with self._lock:
            if self._idle == 0:
                thread = threading.Thread(target=self._run, daemon=True,
                                          name=f"gradsync-torch-{self._name}-callbacks{len(self._threads)}")
                self._threads.append(thread)
                thread.start()
            else:
                self._idle -= 1
        self._queue.put(job)

    def close(self, wait: bool = True) -> None:
        """End every thread once the jobs handed over so far are done (``wait``: join them)."""
        with self._lock:
            threads, self._threads = self._threads, []
        for _ in threads:
            self._queue.put(None)
        for thread in threads if wait else ():
            thread.join()

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            job()
            with self._lock:
                self._idle += 1


class Completer:
    """One process group's completions: callback threads for calls on gradsync handles, and a
    thread (started on the first deferred call, stopped by :meth:`close`) for deferred ones."""

    def __init__(self, name: str, timeout: float | None = None) -> None:
        self._name = name
        self.timeout = timeout  # seconds (the group's); None: calls wait as long as they take
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._callbacks = Callbacks(name)
        self._recent: collections.deque = collections.deque(maxlen=KEEP_ALIVE)
        self._deadlines = Deadlines(name, self._expire)
        self._expired = False  # a call timed out: its thread may wait for it for good
        done: torch.futures.Future = torch.futures.Future()
        done.set_result([])
        self._waited = _Finished(done)  # what finished() returns (a blocking call's Work)

    def work(self, pending: Sequence[Pending], finish: Finish,
             source: Callable[[], int] | None = None, timeout: float | None = None,
             what: str = "") -> FutureWork:
        """A torch ``Work`` whose future gets ``finish(results of pending)`` (or its error);
        ``source``: a receive's sender, for :meth:`FutureWork._source_rank`. The call fails with
        a timeout error (:meth:`_Call.timed_out`, naming ``what``) if it has not finished
        ``timeout`` seconds from now (None: the group's timeout)."""
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout if timeout is not None else None
        call = _Call(pending, finish, deadline, what)
        if deadline is not None:
            self._deadlines.add(call)
        work = self._kept(FutureWork(call.future, source, call))
        if call.deferred:
            self._start()
            self._queue.put(call)
        else:  # once the last handle is done (in the thread completing it): hand over, no more
            GroupHandle("", call.pending).add_done_callback(
                lambda _: call.take() and self._callbacks.run(call.run))
        return work

    def _expire(self, call: _Call) -> None:
        """A call reached its deadline unsettled (the Deadlines thread): fail it in a callback
        thread, where its future's callbacks run."""
        self._expired = True
        self._callbacks.run(lambda: call.settle((None, call.timed_out())))

    def finished(self, handle: Any) -> FutureWork:
        """A blocking call's Work (:class:`waited_at_once` said so), finished here: ``handle``
        waited for in this thread (running the cycle itself, caller runs) until the group's
        timeout, then a completed Work, whose ``wait()`` torch calls next and which it never hands
        on (a blocking call returns None): the same one every time, for calls whose results the
        collective wrote in place. No future chain, no callback thread: the blocking call's fast
        path (a new Work per call cost 9 us of a 4 KiB call's 89).

        Raises:
            the collective's error (as ``wait()`` would); torch's DistBackendError when the group's
            timeout passed first (the collective stays pending, as :class:`Deadlines` leaves it).
        """
        try:
            handle.wait(self.timeout)
        except TimeoutError:
            raise timed_out(handle.name) from None
        return self._waited

    def done(self, outputs: list[torch.Tensor]) -> FutureWork:
        """A ``Work`` already complete with ``outputs`` (a call that moves nothing)."""
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(outputs)
        return self._kept(FutureWork(future))

    def _kept(self, work: FutureWork) -> FutureWork:
        """``work``, referenced until its future completes and among the :data:`KEEP_ALIVE` most
        recent after that (torch < 2.13, see the module docstring)."""
        if KEEP_ALIVE:
            self._recent.append(work)
            future = work.get_future()
            if not future.done():
                future.add_done_callback(lambda _, work=work: self._recent.append(work))
        return work

    def close(self) -> None:
        """Let the thread finish the calls queued so far, then end (and the callback threads).
        After a call timed out, the threads are told to end but not waited for: the thread of
        a deferred call (a barrier some rank never joined) may wait for it as long as gradsync
        does (daemon threads, ended with the process)."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            if not self._expired:
                thread.join()
        self._deadlines.close()
        self._callbacks.close(wait=not self._expired)

    def _start(self) -> None:
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, daemon=True,
                                                    name=f"gradsync-torch-{self._name}")
                    self._thread.start()

    def _run(self) -> None:
        """The deferred calls, in submission order: run here, completed in a callback thread."""
        while (call := self._queue.get()) is not None:
            if call.take() and not call.settled:
                outcome = call.outcome_of()
                self._callbacks.run(lambda call=call, outcome=outcome: call.settle(outcome))
