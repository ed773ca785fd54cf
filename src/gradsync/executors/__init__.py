"""Executors: they run the plans of :mod:`gradsync.engine.fusion` through one interface.

The coordinator builds a :class:`~gradsync.executors.plan.FusionPlan` per response with the executor of
the response's memory (:meth:`Executor.plan`) and hands it (or, for what the executor batches, a
run of consecutive plans of one kind) to :meth:`Executor.run`. Each executor picks its
implementation per collective kind from one table (the idea of Horovod's OperationManager):

* :class:`~gradsync.executors.host.HostExecutor`: host buffers, blocking MPI collectives;
* :class:`~gradsync.executors.device.DeviceExecutor`: device buffers on a CUDA stream of
  gradsync's own, NCCL or staging through pinned host memory.

Neither decides anything a plan has already decided (which tensors, where in the buffer, in place
or packed, the scales and the divisor): they allocate buffers and move them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, Protocol

from ..engine.protocol import Kind, Response
from .plan import FusionPlan


class Executed(NamedTuple):
    """What running plans did: the phases for the timeline, (name, end in perf_counter_ns) each
    starting where the previous ended; and for device work the completion every handle carries,
    (device runtime, device, done event), which :meth:`gradsync.Handle.wait` waits on."""

    phases: tuple[tuple[str, int], ...] = ()
    completion: tuple[Any, int, Any] | None = None


class Executor(Protocol):
    """Runs plans of one kind of memory; see the module docstring."""

    #: The kinds of which consecutive responses of one cycle are run together (one NCCL group).
    batched: frozenset[Kind]

    def plan(self, response: Response, entries: list, divisor: int) -> FusionPlan:
        """The plan of ``response`` for this rank's ``entries``; ``divisor``: of an Average."""

    def run(self, plans: list[FusionPlan]) -> Executed:
        """Carry out ``plans`` (one, or a batch of one kind), writing every result into its entry."""


def batches(responses: Iterable[Response], on_device: Callable[[Response], bool],
            batched: frozenset[Kind]) -> list[list[Response]]:
    """``responses`` in order, in runs to execute together: consecutive device responses of a kind
    in ``batched`` (device allreduces: one NCCL group) form one run, any other response is alone.
    Every rank makes the same runs: ranks agree on every request's kind and device."""
    runs: list[list[Response]] = []
    for response in responses:
        previous = runs[-1][-1] if runs else None
        if (previous is not None and response.kind == previous.kind and response.kind in batched
                and response.error is None and previous.error is None
                and on_device(previous) and on_device(response)):
            runs[-1].append(response)
        else:
            runs.append([response])
    return runs
