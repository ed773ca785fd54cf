"""Negotiation cost versus the number of tensors, with the response cache on and off.

One launch measures every tensor count:

    mpiexec -n 2 python benchmarks/negotiation.py --tensors 10,100,1000

or, with the cache on (default) and off (GRADSYNC_CACHE_CAPACITY=0), interleaved, with a table at
the end:

    python benchmarks/negotiation.py --compare --ranks 2 --repeats 3 [--csv PATH]

A *round* submits N in-place Sum allreduce_async_ of 4-element float32 arrays, under the same N
names every round, then waits for all N; each round starts right after an MPI barrier, its time is
the slowest rank's, and the figure is the median over rounds. The payload is tiny (fused into one
buffer), so the round time is the per-tensor Python path plus negotiation. Cycles per round are
counted by wrapping the coordinator queue's ``wait`` (each return starts a negotiation cycle): a
benchmark-only look inside gradsync; "n/a" if the coordinator has no such method.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


class CycleCounter:
    """Counts the coordinator's negotiation cycles and the time spent in them (Negotiator.cycle:
    cache lookups, the exchange with the other ranks, including waiting for them, and building the
    responses; not the data movement)."""

    def __init__(self) -> None:
        from gradsync.process import runtime

        self.count = 0
        self.seconds = 0.0
        negotiator = runtime.get().coordinator.negotiator
        cycle = negotiator.cycle

        def timed_cycle(*args, **kwargs):
            start = time.perf_counter()
            try:
                return cycle(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.count += 1

        negotiator.cycle = timed_cycle


def measure(tensor_counts: list[int], rounds: int, warmup: int, budget: float) -> None:
    import numpy as np
    from mpi4py import MPI

    import gradsync

    gradsync.init()
    world = MPI.COMM_WORLD
    counter = CycleCounter()
    if world.Get_rank() == 0:
        print(f"cache_capacity={gradsync.process.runtime.get().config.cache_capacity}", flush=True)
    for n in tensor_counts:
        arrays = [np.zeros(4, np.float32) for _ in range(n)]
        names = [f"negotiation.{n}.{i}" for i in range(n)]

        def one_round(arrays=arrays, names=names) -> None:
            handles = [gradsync.allreduce_async_(a, name=name, op=gradsync.Sum)
                       for a, name in zip(arrays, names)]
            for handle in handles:
                gradsync.synchronize(handle)

        for _ in range(warmup):
            one_round()
        start = time.perf_counter()
        one_round()
        probe = time.perf_counter() - start
        count = world.bcast(max(5, min(rounds, int(budget / probe))), root=0)
        times, cycles = [], []
        cycles_before, seconds_before = counter.count, counter.seconds
        for _ in range(count):
            world.Barrier()
            before = counter.count
            start = time.perf_counter()
            one_round()
            times.append(time.perf_counter() - start)
            cycles.append(counter.count - before)
        spent = (counter.seconds - seconds_before) / max(counter.count - cycles_before, 1)
        gathered = world.gather(times, root=0)
        if world.Get_rank() == 0:
            median = statistics.median(max(per_rank) for per_rank in zip(*gathered))
            print(f"tensors={n} rounds={count} ms_per_round={median * 1e3:.4f} "
                  f"cycles_per_round={statistics.median(cycles):g} "
                  f"negotiate_us_per_cycle={spent * 1e6:.2f}", flush=True)
    gradsync.shutdown()


def direct(tensor_counts: list[int], iterations: int) -> None:
    """The negotiation alone, without the coordinator thread or data movement: every rank calls
    Negotiator.cycle() on the same N requests in lockstep (a barrier before each cycle), with the
    response cache primed (steady state) and without it. Prints the median µs per cycle."""
    import dataclasses

    from mpi4py import MPI

    from gradsync.config import Config
    from gradsync.engine.negotiation import Negotiator
    from gradsync.engine.protocol import Kind, ReduceOp, Request

    world = MPI.COMM_WORLD
    comm = world.Dup()
    rank = world.Get_rank()
    for n in tensor_counts:
        requests = [Request(f"direct.{n}.{i}", Kind.ALLREDUCE, rank, "float32", (4,), ReduceOp.Sum)
                    for i in range(n)]
        results = {}
        for mode, capacity in (("on", 1024), ("off", 0)):
            config = dataclasses.replace(Config(), cache_capacity=max(capacity, 0),
                                         stall_check_time_seconds=0)
            negotiator = Negotiator(comm, config)
            times = []
            for i in range(iterations + 5):
                world.Barrier()
                start = time.perf_counter()
                reply = negotiator.cycle(list(requests), False)
                elapsed = time.perf_counter() - start
                for response in reply.responses:  # what the coordinator does after executing
                    for name in response.names:
                        negotiator.completed(requests[int(name.rsplit(".", 1)[1])])
                if i >= 5:
                    times.append(elapsed)
            results[mode] = statistics.median(max(t) for t in zip(*world.allgather(times)))
        if rank == 0:
            print(f"direct tensors={n} cache_on_us_per_cycle={results['on'] * 1e6:.1f} "
                  f"cache_off_us_per_cycle={results['off'] * 1e6:.1f}", flush=True)
    comm.Free()


def parse_line(line: str) -> dict[str, str]:
    return dict(field.split("=", 1) for field in line.split())


def compare(ranks: int, repeats: int, tensors: str, rounds: int, budget: float, csv_path: str | None) -> None:
    """Launch cache on / cache off `repeats` times, interleaved, and print a table of medians."""
    here = os.path.abspath(__file__)
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    base = {k: v for k, v in os.environ.items() if k != "GRADSYNC_CACHE_CAPACITY"}
    base["OMP_NUM_THREADS"] = "1"
    modes = {"on": base, "off": dict(base, GRADSYNC_CACHE_CAPACITY="0")}
    counts = [int(t) for t in tensors.split(",")]
    ms: dict[tuple[str, int], list[float]] = {(m, n): [] for m in modes for n in counts}
    cycles: dict[tuple[str, int], list[float]] = {(m, n): [] for m in modes for n in counts}
    negotiate: dict[tuple[str, int], list[float]] = {(m, n): [] for m in modes for n in counts}
    capacity = {}
    for _ in range(repeats):
        for mode, env in modes.items():
            cmd = [mpiexec, "-n", str(ranks), sys.executable, here, "--tensors", tensors,
                   "--rounds", str(rounds), "--budget", str(budget)]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
            lines = [parse_line(x) for x in out.stdout.splitlines() if "=" in x]
            results = [x for x in lines if "tensors" in x]
            if out.returncode != 0 or len(results) != len(counts):
                raise SystemExit(f"cache {mode} failed:\n{out.stdout}\n{out.stderr}")
            capacity[mode] = next(x["cache_capacity"] for x in lines if "cache_capacity" in x)
            for x in results:
                ms[mode, int(x["tensors"])].append(float(x["ms_per_round"]))
                cycles[mode, int(x["tensors"])].append(float(x["cycles_per_round"]))
                negotiate[mode, int(x["tensors"])].append(float(x["negotiate_us_per_cycle"]))
    print(f"\n{ranks} ranks, 4-element float32 Sum allreduces, median of {repeats} launches; cache "
          f"on: cache_capacity={capacity['on']}, off: cache_capacity={capacity['off']}")
    print(f"{'tensors':>7s} {'on ms/round':>12s} {'off ms/round':>12s} {'off/on':>7s} "
          f"{'on us/tensor':>12s} {'off us/tensor':>13s} {'on cycles':>9s} {'off cycles':>10s} "
          f"{'on us/cycle':>11s} {'off us/cycle':>12s}")
    rows = []
    for n in counts:
        row: dict = {"ranks": ranks, "tensors": n}
        for mode in modes:
            median = statistics.median(ms[mode, n])
            cyc = statistics.median(cycles[mode, n]) if cycles[mode, n] else None
            row |= {f"cache_{mode}_ms_per_round": round(median, 4),
                    f"cache_{mode}_us_per_tensor": round(median * 1e3 / n, 3),
                    f"cache_{mode}_cycles_per_round": "" if cyc is None else cyc,
                    f"cache_{mode}_us_per_cycle": round(statistics.median(negotiate[mode, n]), 2)}
        rows.append(row)

        def shown(value, width, digits):
            return f"{'n/a':>{width}s}" if value == "" else f"{value:{width}.{digits}f}"

        print(f"{n:7d} {row['cache_on_ms_per_round']:12.3f} {row['cache_off_ms_per_round']:12.3f} "
              f"{row['cache_off_ms_per_round'] / row['cache_on_ms_per_round']:7.2f} "
              f"{row['cache_on_us_per_tensor']:12.1f} {row['cache_off_us_per_tensor']:13.1f} "
              f"{shown(row['cache_on_cycles_per_round'], 9, 1)} "
              f"{shown(row['cache_off_cycles_per_round'], 10, 1)} "
              f"{shown(row['cache_on_us_per_cycle'], 11, 1)} {shown(row['cache_off_us_per_cycle'], 12, 1)}")
    if csv_path:
        import benchenv

        env = benchenv.environment(ranks, base)
        env["GRADSYNC_CACHE_CAPACITY"] = f"{capacity['on']} (cache on) / {capacity['off']} (cache off)"
        benchenv.write_csv(csv_path, rows, env)
        print(f"# wrote {csv_path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=str, default="10,100,1000", help="comma separated")
    parser.add_argument("--rounds", type=int, default=200, help="most timed rounds per tensor count")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--budget", type=float, default=2.0,
                        help="seconds of timed rounds per tensor count (fewer rounds, never under 5)")
    parser.add_argument("--compare", action="store_true", help="cache on and off, in sub-processes")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--csv", type=str, default=None, help="--compare: also write the table here")
    parser.add_argument("--direct", action="store_true",
                        help="time Negotiator.cycle alone, in lockstep, cache on and off")
    args = parser.parse_args()
    if args.direct:
        direct([int(t) for t in args.tensors.split(",")], args.rounds)
    elif args.compare:
        compare(args.ranks, args.repeats, args.tensors, args.rounds, args.budget, args.csv)
    else:
        measure([int(t) for t in args.tensors.split(",")], args.rounds, args.warmup, args.budget)


if __name__ == "__main__":
    main()
