"""Running a cycle's responses on this rank: plan, execute, complete or fail the handles.

:class:`ResponseExecution` is an object the coordinator holds (:mod:`gradsync.engine.coordinator`), given
its collaborators explicitly, grouped (:mod:`gradsync.engine.parts`): the coordinator's pending entries
(which it fills and this object empties), its queue, negotiator and executors, and its place in the
process set. It runs on the thread that holds the coordinator's lock, like the rest of a cycle.

The Average divisor is decided here, once per response (:meth:`ResponseExecution.divisor`): the
set's size, or with ``GRADSYNC_JOIN_DIVISOR=contributors`` the ranks that had not joined. The plan
applies it (:func:`gradsync.executors.plan.reduction`) and every handle carries it
(:attr:`gradsync.Handle.divisor`), so that a framework layer that finishes an Average itself (the
sparse gradients' allgather, Horovod's integer scaling) divides by the same number.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from ..errors import CollectiveError
from ..executors import Executed, Executor, batches
from ..executors.plan import FusionPlan
from ..timeline import record_collective
from . import joins
from .parts import CycleParts, SetPlace
from .protocol import Kind, Response
from .request_queue import Entry

#: What running no plan did (the timeline's phases of a failed response).
_NOTHING_EXECUTED = Executed()


class ResponseExecution:
    """How a coordinator carries out the responses of one cycle, in order (every rank runs the
    same ones in the same order).

    Args:
        parts: the coordinator's collaborators: its pending entries by name (this object takes out
            each response's entries), its queue (whether gradsync stopped; names in flight
            released), its negotiator (told of every completed request), its host and device
            executors.
        place: this rank's place in the process set (its rank and size; messages name world ranks
            and, for a set other than the world, the set).
        join_divisor: ``"size"`` or ``"contributors"`` (``GRADSYNC_JOIN_DIVISOR``).
        autotuner: records the bytes of host allreduces, or None.
        timeline: the coordinator's timeline, or None.

    Attributes read by the coordinator: ``timeline`` (set by it), ``busy`` (for the watchdog),
    ``joins`` (join() calls completed on this set, the same count on every member).
    """

    def __init__(self, parts: CycleParts, place: SetPlace, *, join_divisor: str,
                 autotuner: Any = None, timeline: Any = None) -> None:
        self._pending, self._queue, self._negotiator = parts.pending, parts.queue, parts.negotiator
        self._host, self._device = parts.host, parts.device
        self._rank, self._size, self._world = place.rank, place.size, place.world
        self._world_rank = place.world_rank
        self._join_divisor, self._set_note, self._autotuner = join_divisor, place.note(), autotuner
        self.timeline = timeline
        self.busy: tuple[float, object] | None = None
        self.joins = 0
        # The entries the last cycle completed, released when the next cycle starts; see _retire.
        self._retired: list[Entry] = []

    def run(self, responses: tuple[Response, ...], replied_ns: int) -> bool:
        """Run the cycle's responses in order, in the batches of :func:`~gradsync.executors.batches`
        (every rank makes the same ones); False once gradsync stopped meanwhile. The entries the
        previous cycle completed are released first (see :meth:`_retire`)."""
        self._retired = []
        for batch in batches(responses, self._on_device, self._device.batched):
            if not self._carry_out(batch, replied_ns):
                return False
        return True

    def divisor(self, response: Response) -> int:
        """The Average divisor of ``response``, the rule written once: the set's size, or the
        ranks that had not joined when ``GRADSYNC_JOIN_DIVISOR=contributors``. The same on every
        rank (the response and the setting are)."""
        if self._join_divisor == "contributors" and response.contributors:
            return response.contributors
        return self._size

    def _on_device(self, response: Response) -> bool:
        entry = self._pending.get(response.names[0])
        request = entry.request if entry is not None else response.requests[0]
        return request.device != "cpu"

    def _carry_out(self, responses: list[Response], replied_ns: int) -> bool:
        """:meth:`_execute` with the watchdog told what this rank is inside; False once gradsync
        has stopped (the watchdog's verdict): then no further collective may start."""
        if self._queue.closed:
            return False
        self.busy = (time.monotonic(), responses[0])  # liveness.described, if a verdict needs it
        try:
            self._execute(responses, replied_ns)
        finally:
            self.busy = None
        return not self._queue.closed

    def _execute(self, responses: list[Response], replied_ns: int) -> None:
        """Plan and run ``responses`` (one, or a batch) and complete their handles."""
        taken: list[tuple[Response, list[Entry]]] = []
        everything: list[Entry] = []
        # Names are released before the handles complete: a caller that reuses a name right after
        # synchronize() returned must not find it still in flight.
        names: list[str] = []
        divisors: list[int] = []
        for response in responses:  # one loop, no comprehensions: a cycle's fixed cost
            entries = self._entries(response)
            taken.append((response, entries))
            everything += entries
            names += response.names
            divisors.append(self.divisor(response))
        started_ns = time.perf_counter_ns()
        executed = _NOTHING_EXECUTED
        try:
            plans = [self._plan(response, entries, divisor)
                     for (response, entries), divisor in zip(taken, divisors)]
            executed = self._executor_for(plans[0].entries).run(plans)
        except Exception as exc:
            self._failed(responses[0], everything, names, exc)
        else:
            self._completed(taken, divisors, names, executed)
        finally:
            if self.timeline is not None:
                record_collective(self.timeline, everything, replied_ns, started_ns, executed.phases)

    def _entries(self, response: Response) -> list[Entry]:
        """This rank's entries of ``response``, or a joined rank's stand-ins."""
        if response.error is not None:  # a failed group may name members this rank never submitted
            return [self._pending.pop(name) for name in response.names if name in self._pending]
        entries = []
        for i, name in enumerate(response.names):
            entry = self._pending.pop(name, None)
            if entry is None:
                entry = joins.stand_in(response.requests[i], self._rank, self._size)
                if entry.request.device != "cpu":
                    entry = self._device.stand_in(entry)
            entries.append(entry)
        return entries

    def _plan(self, response: Response, entries: list[Entry], divisor: int) -> FusionPlan:
        """The plan of ``response``, by the executor of its memory, dividing an Average by
        ``divisor``.

        Raises:
            CollectiveError: the response is a negotiated error (the same on every rank).
        """
        if response.error is not None:
            raise CollectiveError(f"gradsync: rank {self._world_rank}: {response.error}{self._set_note}")
        return self._executor_for(entries).plan(response, entries, divisor)

    def _executor_for(self, entries: Sequence[Entry]) -> Executor:
        return self._device if entries and entries[0].runtime is not None else self._host

    def _completed(self, taken: list[tuple[Response, list[Entry]]], divisors: list[int],
                   names: list[str], executed: Executed) -> None:
        """Complete the handles of every response of the batch, each with its divisor."""
        self._queue.finished(names)
        first, entries = taken[0]
        if first.kind == Kind.JOIN:
            entries[0].result = self._world(first.last_joined)
            self.joins += 1
        completed, completion = self._negotiator.completed, executed.completion
        for (_, entries), divisor in zip(taken, divisors):
            for entry in entries:
                completed(entry.request)
                entry.handle.complete(entry.result, completion, divisor)
            self._retire(entries)
        if self._autotuner is not None and first.kind == Kind.ALLREDUCE and completion is None:
            self._autotuner.record(sum(entry.source.nbytes for _, es in taken for entry in es))

    def _retire(self, entries: list[Entry]) -> None:
        """Keep the completed ``entries`` (and so their tensors' memory) referenced until the next
        cycle starts. A training loop frees its gradients right after the step
        (``zero_grad(set_to_none=True)``); freed then, at the top of glibc's heap, 50 MB of them
        are returned to the system (heap trimming) and the next backward page-faults them back
        in (+25 ms per step on the MLP of benchmarks/train_step.py, 14k faults). Released at the
        next cycle, which the next backward's first gradient starts, they are freed below the
        new gradients and their pages are reused (docs/architecture.md, "Memory of completed
        tensors")."""
        self._retired.extend(entries)

    def _failed(self, response: Response, entries: list[Entry], names: list[str],
                exc: Exception) -> None:
        """Fail the handles of ``entries`` with ``exc``; an error that is not a CollectiveError (an
        MPI or NCCL error, a bug) is raised again afterwards: it stops the coordinator."""
        error = exc
        if not isinstance(exc, CollectiveError):
            listed = ", ".join(repr(e.request.name) for e in entries)
            error = CollectiveError(f"gradsync: rank {self._world_rank}: {response.kind.name.lower()} "
                                    f"of {listed} failed: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
        self._queue.finished(names)
        for entry in entries:
            entry.handle.fail(error)
        if error is not exc:
            raise exc

