"""Latency of a blocking ``torch.distributed.all_reduce`` on gradsync's backend, beside gloo and raw MPI.

    mpiexec -n 2 python benchmarks/dist_allreduce.py [--bytes 4K] [--iters 2000] [--csv PATH]

One launch: torch.distributed's default group on gloo (a TCP rendezvous on 127.0.0.1) and a group of
every rank on gradsync's backend (``new_group(backend="gradsync")``, docs/torch-distributed.md).
Each iteration times, in turn, a float32 SUM ``dist.all_reduce`` of ``--bytes`` on the gradsync
group, the same on gloo, the same on a *direct* group (a Python process group defined here whose
``allreduce`` calls ``MPI_Allreduce`` on the tensor's memory and returns one completed Work: no
engine, no negotiation, no checks; the floor of any ``torch.distributed`` backend written in
Python over MPI), the same after the exchange of a cached negotiation (one
small nonblocking allreduce first, the floor of any backend that agrees on every collective
before running it; the row *negotiated*), ``gradsync.allreduce_`` under one name (the engine's own path, response cache
warm) and ``comm.Allreduce`` on MPI_COMM_WORLD; each call starts right after an MPI barrier and
an iteration's time is the slowest rank's. Rank 0 prints the median and the 90th percentile of each
(milliseconds) and each one's ratio to raw MPI. Issue 35's target: the gradsync row <= 0.1 ms at 4 KiB.

``--phases`` also times the gradsync row's parts on rank 0 (wrappers around a few of the engine's
methods, which add about a microsecond each to every gradsync row of that launch): torch's
``dist.all_reduce`` up to the group's ``allreduce``, the group's own Python (the call's name, the
reduction) up to ``allreduce_async_``, the submission (checks, the entry) and its queueing, the way
to the cycle, the negotiation (its one small allreduce when cached), the planning up to
the data's MPI call, that call, the completion back to the group's return, and the way back to the
caller; it prints each part's median in microseconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import benchenv
import numpy as np
import torch
import torch.distributed as dist
from collectives import parse_bytes
from mpi4py import MPI

import gradsync
import gradsync.torch  # noqa: F401  (registers backend "gradsync")


class _Done(dist.Work):
    """A Work that is already complete (the direct group's, reused by every call)."""

    def wait(self, timeout: object = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class DirectGroup(dist.ProcessGroup):
    """The floor row's process group: ``allreduce`` (SUM) is ``MPI_Allreduce`` in place, nothing else."""

    def __init__(self, rank: int, size: int) -> None:
        super().__init__(rank, size)
        self.comm = MPI.COMM_WORLD.Dup()
        self.done = _Done()

    def allreduce(self, tensors, opts=None):
        for tensor in tensors if isinstance(tensors, list) else [tensors]:
            self.comm.Allreduce(MPI.IN_PLACE, tensor.numpy())
        return self.done

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return "direct"


class NegotiatedGroup(DirectGroup):
    """The *negotiated* row: before each ``MPI_Allreduce``, the exchange of gradsync's
    cached negotiation, one nonblocking bitwise-AND allreduce of its 264-byte vector (1024 cache
    bits, 1024 invalid bits, a flags word) completed by ``MPI_Wait``, and nothing else: the floor
    of any backend that agrees on every collective before it runs it, with no Python around it."""

    def __init__(self, rank: int, size: int) -> None:
        super().__init__(rank, size)
        self.vector = np.zeros(33, np.uint64)

    def allreduce(self, tensors, opts=None):
        self.comm.Iallreduce(MPI.IN_PLACE, self.vector, op=MPI.BAND).Wait()
        return super().allreduce(tensors, opts)

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return "negotiated"


def _direct(opts, pg_options=None) -> DirectGroup:
    return DirectGroup(opts.group_rank, opts.group_size)


def _negotiated(opts, pg_options=None) -> NegotiatedGroup:
    return NegotiatedGroup(opts.group_rank, opts.group_size)


class Phases:
    """``--phases``: timestamps at the boundaries of a gradsync ``dist.all_reduce`` (wrappers
    around the engine's methods named in :data:`BOUNDS`), split into the parts of :data:`PARTS`."""

    #: (object, method, stamp on entry, stamp on return)
    BOUNDS = (("group", "allreduce", "group", "group_returned"),
              ("ops", "allreduce_async_", "submitting", None),
              ("coordinator", "submit_group", "queueing", "queued"),
              ("negotiation", "cycle", "negotiating", "negotiated"),
              ("mpi", "allreduce", "data", "data_done"))
    PARTS = (("torch's dist.all_reduce, to the group", "start", "group"),
             ("the group's Python: name, reduction", "group", "submitting"),
             ("submission: checks, entry, handle", "submitting", "queueing"),
             ("queueing", "queueing", "queued"),
             ("to the cycle (wait, take, stall check)", "queued", "negotiating"),
             ("negotiation (cached: one small allreduce)", "negotiating", "negotiated"),
             ("planning, to the data's MPI call", "negotiated", "data"),
             ("the data: MPI_Iallreduce and its wait", "data", "data_done"),
             ("completion, to the group's return", "data_done", "group_returned"),
             ("back to the caller", "group_returned", "end"))

    def __init__(self) -> None:
        from gradsync.backends import mpi
        from gradsync.engine import coordinator, negotiation
        from gradsync.torch.distributed import group

        owners = {"group": group.GradsyncProcessGroup, "ops": gradsync.ops,
                  "coordinator": coordinator.Coordinator, "negotiation": negotiation.Negotiator,
                  "mpi": mpi.MpiBackend}
        self.stamps: dict[str, int] = {}
        self.parts: dict[str, list[float]] = {label: [] for label, *_ in self.PARTS}
        for owner, method, entered, returned in self.BOUNDS:
            self._wrap(owners[owner], method, entered, returned)

    def _wrap(self, owner, method: str, entered: str, returned: str | None) -> None:
        wrapped, stamps, clock = getattr(owner, method), self.stamps, time.perf_counter_ns

        def timed_call(*args, **kwargs):
            stamps[entered] = clock()
            try:
                return wrapped(*args, **kwargs)
            finally:
                if returned is not None:
                    stamps[returned] = clock()
        setattr(owner, method, timed_call)

    def call(self, call):
        """``call`` with the start and end stamped; the parts recorded afterwards by :meth:`record`."""
        def stamped():
            self.stamps.clear()
            self.stamps["start"] = time.perf_counter_ns()
            call()
            self.stamps["end"] = time.perf_counter_ns()
        return stamped

    def record(self) -> None:
        for label, start, end in self.PARTS:
            if start in self.stamps and end in self.stamps:
                self.parts[label].append((self.stamps[end] - self.stamps[start]) / 1e3)

    def print(self) -> None:
        print("\nwhere a gradsync dist.all_reduce spends its time (rank 0, median us, --phases):")
        for label, values in self.parts.items():
            if values:
                print(f"  {label:<44}{statistics.median(values):>8.1f}")


def timed(world: MPI.Comm, call) -> float:
    """The slowest rank's seconds for ``call()``, started right after a barrier."""
    world.Barrier()
    start = time.perf_counter()
    call()
    return world.allreduce(time.perf_counter() - start, op=MPI.MAX)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bytes", default="4K", help="message size (binary units: 4K, 1M)")
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--csv", default=None)
    parser.add_argument("--phases", action="store_true", help="also time the gradsync row's parts")
    args = parser.parse_args()
    environ = dict(os.environ)
    torch.set_num_threads(1)
    gradsync.init()
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    port = world.bcast(29500 + os.getpid() % 1000, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    group = dist.new_group(backend="gradsync")
    dist.Backend.register_backend("direct", _direct, extended_api=True, devices=["cpu"])
    direct = dist.new_group(backend="direct")
    dist.Backend.register_backend("negotiated", _negotiated, extended_api=True, devices=["cpu"])
    negotiated = dist.new_group(backend="negotiated")
    count = parse_bytes(args.bytes) // 4
    tensor = torch.ones(count, dtype=torch.float32)
    array = np.ones(count, dtype=np.float32)
    calls = {
        "dist.all_reduce, gradsync": lambda: dist.all_reduce(tensor, group=group),
        "dist.all_reduce, gloo": lambda: dist.all_reduce(tensor),
        "dist.all_reduce, direct": lambda: dist.all_reduce(tensor, group=direct),
        "dist.all_reduce, negotiated": lambda: dist.all_reduce(tensor, group=negotiated),
        "gradsync.allreduce_": lambda: gradsync.allreduce_(array, name="latency", op=gradsync.Sum),
        "MPI Allreduce": lambda: world.Allreduce(MPI.IN_PLACE, array),
    }
    phases = Phases() if args.phases else None
    if phases is not None:
        calls["dist.all_reduce, gradsync"] = phases.call(calls["dist.all_reduce, gradsync"])
    times: dict[str, list[float]] = {name: [] for name in calls}
    for i in range(args.warmup + args.iters):
        for name, call in calls.items():
            tensor.fill_(1.0)
            array.fill(1.0)
            seconds = timed(world, call)
            result = float(tensor[-1]) if name.startswith("dist") else float(array[-1])
            if result != size:
                raise SystemExit(f"rank {rank}: {name} gave {result}, expected {size}")
            if i >= args.warmup:
                times[name].append(seconds * 1e3)
                if phases is not None and name == "dist.all_reduce, gradsync":
                    phases.record()
    dist.destroy_process_group()
    if rank != 0:
        return
    raw = statistics.median(times["MPI Allreduce"])
    print(f"blocking allreduce of {args.bytes}B float32, {size} ranks, {args.iters} iterations, "
          f"interleaved; {benchenv.mpi_library()}")
    print(f"{'call':<28}{'median ms':>12}{'p90 ms':>10}{'vs MPI':>10}")
    rows = []
    for name, values in times.items():
        median, p90 = statistics.median(values), statistics.quantiles(values, n=10)[-1]
        rows.append({"call": name, "median_ms": median, "p90_ms": p90, "vs_mpi": median / raw})
        print(f"{name:<28}{median:>12.4f}{p90:>10.4f}{median / raw:>10.1f}")
    if phases is not None:
        phases.print()
    if args.csv:
        benchenv.write_csv(args.csv, rows, benchenv.environment(size, environ))


if __name__ == "__main__":
    main()
