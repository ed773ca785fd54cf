"""Running a cycle's responses on this rank: plan, execute, complete or fail the handles.

The second half of :class:`gradsync.coordinator.Coordinator` (a mixin: it runs on the thread that
holds the coordinator's lock, and uses the coordinator's pending entries, queue, executors,
negotiator and timeline; see that module's docstring).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from . import joins, liveness
from .errors import CollectiveError
from .executors import Executed, Executor, batches
from .fusion import FusionPlan
from .protocol import Kind, Response
from .queue import Entry
from .timeline import record_collective


class ResponseExecution:
    """How a coordinator carries out the responses of one cycle, in order (every rank runs the
    same ones in the same order)."""

    def _execute_all(self, responses: tuple[Response, ...], replied_ns: int) -> bool:
        """Run the cycle's responses in order, in the batches of :func:`~gradsync.executors.batches`
        (every rank makes the same ones); False once gradsync stopped meanwhile."""
        return all(self._carry_out(batch, replied_ns)
                   for batch in batches(responses, self._on_device, self.device.batched))

    def _on_device(self, response: Response) -> bool:
        entry = self._pending.get(response.names[0])
        request = entry.request if entry is not None else response.requests[0]
        return request.device != "cpu"

    def _carry_out(self, responses: list[Response], replied_ns: int) -> bool:
        """:meth:`_execute` with the watchdog told what this rank is inside; False once gradsync
        has stopped (the watchdog's verdict): then no further collective may start."""
        if self.queue.closed:
            return False
        self.busy = (time.monotonic(), liveness.Described(responses[0]))
        try:
            self._execute(responses, replied_ns)
        finally:
            self.busy = None
        return not self.queue.closed

    def _execute(self, responses: list[Response], replied_ns: int) -> None:
        """Plan and run ``responses`` (one, or a batch) and complete their handles."""
        taken = [(response, self._entries(response)) for response in responses]
        everything = [entry for _, entries in taken for entry in entries]
        # Names are released before the handles complete: a caller that reuses a name right after
        # synchronize() returned must not find it still in flight.
        names = [name for response, _ in taken for name in response.names]
        started_ns = time.perf_counter_ns()
        executed = Executed()
        try:
            plans = [self._plan(response, entries) for response, entries in taken]
            executed = self._executor(plans[0]).run(plans)
        except Exception as exc:
            self._failed(responses[0], everything, names, exc)
        else:
            self._completed(responses[0], everything, names, executed)
        finally:
            if self.timeline is not None:
                record_collective(self.timeline, everything, replied_ns, started_ns, executed.phases)

    def _entries(self, response: Response) -> list[Entry]:
        """This rank's entries of ``response``, or a joined rank's stand-ins."""
        if response.error is not None:  # a failed group may name members this rank never submitted
            return [self._pending.pop(name) for name in response.names if name in self._pending]
        stand_ins = dict(zip(response.names, response.requests))
        entries = []
        for name in response.names:
            entry = self._pending.pop(name, None)
            if entry is None:
                entry = joins.stand_in(stand_ins[name], self.rank, self.size)
                if entry.request.device != "cpu":
                    entry = self.device.stand_in(entry)
            entries.append(entry)
        return entries

    def _plan(self, response: Response, entries: list[Entry]) -> FusionPlan:
        """The plan of ``response``, by the executor of its memory.

        Raises:
            CollectiveError: the response is a negotiated error (the same on every rank).
        """
        if response.error is not None:
            raise CollectiveError(f"gradsync: rank {self.world_rank}: {response.error}"
                                  f"{self._set_ranks_note()}")
        divisor = self.size
        if self._join_divisor == "contributors" and response.contributors:
            divisor = response.contributors  # Average over the ranks that had not joined
        return self._executor_for(entries).plan(response, entries, divisor)

    def _executor_for(self, entries: Sequence[Entry]) -> Executor:
        return self.device if entries and entries[0].runtime is not None else self.host

    def _executor(self, plan: FusionPlan) -> Executor:
        return self._executor_for(plan.entries)

    def _completed(self, response: Response, entries: list[Entry], names: list[str],
                   executed: Executed) -> None:
        self.queue.finished(names)
        if response.kind == Kind.JOIN:
            entries[0].result = self._world(response.last_joined)
            self.joins += 1
        for entry in entries:
            self.negotiator.completed(entry.request)
            entry.handle._set_result(entry.result, executed.completion)
        self._retire(entries)
        if self._autotuner is not None and response.kind == Kind.ALLREDUCE and executed.completion is None:
            self._autotuner.record(sum(entry.source.nbytes for entry in entries))

    def _retire(self, entries: list[Entry]) -> None:
        """Keep the completed ``entries`` (and so their tensors' memory) referenced until the next
        cycle starts. A training loop frees its gradients right after the step
        (``zero_grad(set_to_none=True)``); freed then, at the top of glibc's heap, 50 MB of them
        are returned to the system (heap trimming) and the next backward page-faults them back
        in (+25 ms per step on the MLP of benchmarks/train_step.py, 14k faults). Released at the
        next cycle, which the next backward's first gradient starts, they are freed below the
        new gradients and their pages are reused. The coordinator before the engine refactor
        held them so by accident (a loop variable); docs/architecture.md, "Memory of completed
        tensors"."""
        self._retired.extend(entries)

    def _failed(self, response: Response, entries: list[Entry], names: list[str],
                exc: Exception) -> None:
        """Fail the handles of ``entries`` with ``exc``; an error that is not a CollectiveError (an
        MPI or NCCL error, a bug) is raised again afterwards: it stops the coordinator."""
        error = exc
        if not isinstance(exc, CollectiveError):
            listed = ", ".join(repr(e.request.name) for e in entries)
            error = CollectiveError(f"gradsync: rank {self.world_rank}: {response.kind.name.lower()} "
                                    f"of {listed} failed: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
        self.queue.finished(names)
        for entry in entries:
            entry.handle._set_error(error)
        if error is not exc:
            raise exc

