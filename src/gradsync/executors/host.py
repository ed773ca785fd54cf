"""The host executor: plans of host (numpy) memory, run with blocking MPI collectives.

An allreduce whose op is Adasum runs :func:`gradsync.executors.adasum.reduce` (pairwise MPI_Sendrecv levels
on the backend's communicator) in place of MPI_Allreduce, on the plan's float64 buffer.

Only the thread running the coordinator's cycle calls it (it owns the backend's communicators).
Fusion buffers are reused from cycle to cycle, one per accumulator dtype, plus a second set for
what reducescatter and a grouped allgather receive.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from ..backends.mpi import MpiBackend
from ..engine.protocol import Kind, ReduceOp, Response
from . import Executed, adasum
from .memory import HOST, FusionBuffers
from .plan import Context, FusionPlan, make_plan, pack, unpack

Phases = list[tuple[str, int]]


class HostExecutor:
    """Runs host plans with ``backend`` for rank ``rank`` of ``size``; see the module docstring."""

    batched: frozenset[Kind] = frozenset()

    def __init__(self, backend: MpiBackend, rank: int, size: int) -> None:
        self.backend = backend
        self.rank, self.size = rank, size
        self._buffers = FusionBuffers()
        self._received = FusionBuffers()
        self._contexts: dict[int, Context] = {}  # divisor -> this rank's plan context
        self._table: dict[Kind, Callable[[FusionPlan], Phases]] = {
            Kind.ALLREDUCE: self._allreduce, Kind.REDUCESCATTER: self._reducescatter,
            Kind.BROADCAST: self._broadcast, Kind.ALLGATHER: self._allgather,
            Kind.ALLTOALL: self._alltoall, Kind.BARRIER: _nothing, Kind.JOIN: _nothing}

    def plan(self, response: Response, entries: list, divisor: int) -> FusionPlan:
        """See :meth:`gradsync.executors.Executor.plan`."""
        context = self._contexts.get(divisor)
        if context is None:  # one per divisor (the set's size, or the contributors): built once
            context = self._contexts[divisor] = Context(self.rank, self.size, divisor, HOST,
                                                        self.backend.traits)
        return make_plan(response, entries, context)

    def run(self, plans: list[FusionPlan]) -> Executed:
        """See :meth:`gradsync.executors.Executor.run`; blocks until the data has moved."""
        phases: Phases = []
        for plan in plans:
            phases += self._table[plan.kind](plan)
        return Executed(tuple(phases))

    def _send_buffer(self, plan: FusionPlan, array: np.ndarray) -> np.ndarray:
        """``array``'s own memory for an in-place plan, else the fusion buffer of ``plan.dtype``."""
        return HOST.flat(array) if plan.in_place else self._buffers.get(plan.dtype, plan.count)

    def _allreduce(self, plan: FusionPlan) -> Phases:
        buffer = self._send_buffer(plan, plan.entries[0].target)
        phases = []
        if plan.packs:
            pack(plan, HOST, buffer)
            phases.append(("MEMCPY_IN_FUSION_BUFFER", time.perf_counter_ns()))
        finish = plan.reduction
        # A lone tensor's Average (or postscale) in its own memory: where the backend can, it
        # scales each slice as it reduces it, instead of unpack's second pass over the result.
        folded = (finish.scale != 1.0 and plan.result_in_buffer and finish.floor_divisor == 1
                  and finish.send_op != ReduceOp.Adasum
                  and self.backend.scales_in_allreduce(buffer, finish.send_op))
        if finish.send_op == ReduceOp.Adasum:
            received = self._received.get(plan.dtype, plan.count)
            adasum.reduce(buffer, received, plan.bounds, self.rank, self.size, self.backend.sendrecv)
        elif plan.from_source:  # an out-of-place lone tensor, sent from its input
            self.backend.allreduce(buffer, finish.send_op, finish.logical, finish.scale if folded else 1.0,
                                   HOST.flat(plan.entries[0].source))
        elif folded:
            self.backend.allreduce(buffer, finish.send_op, finish.logical, finish.scale)
        else:
            self.backend.allreduce(buffer, finish.send_op, finish.logical)
        phases.append(("ALLREDUCE", time.perf_counter_ns()))
        if not folded and plan.unpacks:
            unpack(plan, HOST, buffer)
            phases.append(("MEMCPY_OUT_FUSION_BUFFER", time.perf_counter_ns()))
        return phases

    def _reducescatter(self, plan: FusionPlan) -> Phases:
        send = self._send_buffer(plan, plan.entries[0].source)
        pack(plan, HOST, send)
        phases = [("MEMCPY_IN_FUSION_BUFFER", time.perf_counter_ns())] if plan.packs else []
        receive = self._received.get(plan.dtype, plan.counts[self.rank])
        self.backend.reducescatter(send, receive, list(plan.counts), plan.reduction.send_op,
                                    plan.reduction.logical)
        phases.append(("REDUCESCATTER", time.perf_counter_ns()))
        unpack(plan, HOST, receive)
        return phases + [("MEMCPY_OUT_FUSION_BUFFER", time.perf_counter_ns())]

    def _broadcast(self, plan: FusionPlan) -> Phases:
        buffer = self._send_buffer(plan, plan.entries[0].target)
        pack(plan, HOST, buffer)
        self.backend.broadcast(buffer, plan.root)
        unpack(plan, HOST, buffer)
        return [("BROADCAST", time.perf_counter_ns())]

    def _allgather(self, plan: FusionPlan) -> Phases:
        _allocate(plan)
        send = self._send_buffer(plan, plan.entries[0].source)
        pack(plan, HOST, send)
        total = sum(plan.counts)
        receive = (HOST.flat(plan.entries[0].target) if plan.received_in_output
                   else self._received.get(plan.dtype, total))
        self.backend.allgather(send, receive, [n * plan.dtype.itemsize for n in plan.counts])
        unpack(plan, HOST, receive)
        return [("ALLGATHER", time.perf_counter_ns())]

    def _alltoall(self, plan: FusionPlan) -> Phases:
        entry = plan.entries[0]
        entry.result, entry.target = entry.allocate(plan.out_shapes[0], list(plan.rows))
        send = self._send_buffer(plan, entry.source)
        pack(plan, HOST, send)
        itemsize = plan.dtype.itemsize
        self.backend.alltoall(send, entry.target, [n * itemsize for n in plan.send_counts],
                               [n * itemsize for n in plan.counts])
        return [("ALLTOALL", time.perf_counter_ns())]


def _allocate(plan: FusionPlan) -> None:
    """Allocate each member's output (allgather) from the shape the plan computed."""
    for entry, shape in zip(plan.entries, plan.out_shapes):
        entry.result, entry.target = entry.allocate(shape)


def _nothing(plan: FusionPlan) -> Phases:
    """Barrier and join: negotiation itself proved that every rank arrived."""
    return []
