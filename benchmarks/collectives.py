"""Allreduce bandwidth sweep in the style of nccl-tests: gradsync vs raw mpi4py on the same buffers.

    mpiexec -n 2 python benchmarks/collectives.py [--min-bytes 8] [--max-bytes 256M] [--csv PATH]
    mpiexec -n 2 python benchmarks/collectives.py --idle-impact [--csv PATH]

Sweep: for each message size (powers of --factor, default 2), float32 Sum allreduce in place, of
``gradsync.allreduce_(buf, name=..., op=Sum)`` (the same name every iteration, so the response cache
is warm) and of ``comm.Allreduce(MPI.IN_PLACE, buf)`` on COMM_WORLD, alternating one of each per
iteration. Every timed call starts right after an MPI barrier; an iteration's time is the slowest
rank's; the table shows the median over iterations. The iteration count per size is --iters, scaled
down so that each size takes about --budget seconds (never fewer than --min-iters).

    algbw = bytes / time                 (GB/s = 1e9 bytes/s, as nccl-tests)
    busbw = algbw * 2 (n - 1) / n        (the per-link traffic of a ring allreduce on n ranks)
    ratio = gradsync algbw / raw algbw   (1.0: gradsync adds nothing to the MPI call)

--idle-impact: does gradsync, initialised but idle, slow the user's own MPI traffic? Times raw
16 MiB allreduces (--idle-bytes) in the main thread with no gradsync running and with gradsync
initialised and its coordinator idle, in --rounds alternating phases of one run (init() and
shutdown() between phases), and prints both medians and their ratio; the design allows 1.20.
Rank 0 prints; the other ranks only take part.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import benchenv
import numpy as np
from mpi4py import MPI

import gradsync

SUFFIXES = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_bytes(text: str) -> int:
    """'8', '4K', '256M', '1G' (binary units) -> bytes."""
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in SUFFIXES:
        return int(float(text[:-1]) * SUFFIXES[text[-1]])
    return int(text)


def format_bytes(n: int) -> str:
    for suffix, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {suffix}iB"
    return f"{n} B"


def message_sizes(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    size, sizes = max(4, min_bytes - min_bytes % 4), []
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes


def timed(world: MPI.Comm, call) -> float:
    """Seconds this rank spends in ``call()``, started right after a barrier."""
    world.Barrier()
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def slowest_rank_median(world: MPI.Comm, times: list[float]) -> float | None:
    """On rank 0: the median over iterations of the slowest rank's time; None elsewhere."""
    gathered = world.gather(times, root=0)
    if world.Get_rank() != 0:
        return None
    return statistics.median(max(per_rank) for per_rank in zip(*gathered))


def check_results(world: MPI.Comm, buf: np.ndarray) -> None:
    """Both allreduces give the right sum before anything is timed."""
    n = world.Get_size()
    expected = n * (n + 1) / 2
    view = buf[:1024]
    for label, call in (("raw", lambda: world.Allreduce(MPI.IN_PLACE, view, op=MPI.SUM)),
                        ("gradsync", lambda: gradsync.allreduce_(view, name="collectives.check",
                                                                 op=gradsync.Sum))):
        view.fill(world.Get_rank() + 1)
        call()
        if not np.all(view == expected):
            raise SystemExit(f"{label} allreduce gave {view[:4]}, expected {expected}")
    buf.fill(0.0)  # zeros from now on: repeated in-place sums stay 0, never inf


def sweep(args: argparse.Namespace, world: MPI.Comm) -> None:
    rank, n = world.Get_rank(), world.Get_size()
    sizes = message_sizes(args.min_bytes, args.max_bytes, args.factor)
    buf = np.empty(sizes[-1] // 4, np.float32)
    buf.fill(0.0)  # touch every page before timing
    check_results(world, buf)
    if rank == 0:
        print(f"# float32 Sum allreduce in place, {n} ranks: gradsync.allreduce_ vs mpi4py "
              "comm.Allreduce(MPI.IN_PLACE)")
        print(f"# {benchenv.mpi_library()}; time: median of the slowest rank's, us; bandwidth: GB/s")
        print(f"# {'':30s}{'gradsync':^28s}  {'raw mpi4py':^28s}")
        print(f"# {'size':>10s} {'count':>10s} {'iters':>6s}"
              + f" {'time':>10s} {'algbw':>8s} {'busbw':>8s}" * 2 + f" {'ratio':>7s}", flush=True)
    rows = []
    for nbytes in sizes:
        view = buf[:nbytes // 4]
        name = f"collectives.{nbytes}"

        def raw(view=view):
            world.Allreduce(MPI.IN_PLACE, view, op=MPI.SUM)

        def ours(view=view, name=name):
            gradsync.allreduce_(view, name=name, op=gradsync.Sum)

        for _ in range(args.warmup):
            raw()
            ours()
        probe = max(timed(world, raw), timed(world, ours))
        iters = world.bcast(max(args.min_iters, min(args.iters, int(args.budget / 2 / probe))), root=0)
        raw_times, our_times = [], []
        for i in range(iters):  # alternate which goes first, so neither always follows the other
            for call in ((raw, ours) if i % 2 == 0 else (ours, raw)):
                (raw_times if call is raw else our_times).append(timed(world, call))
        raw_time = slowest_rank_median(world, raw_times)
        our_time = slowest_rank_median(world, our_times)
        if rank != 0:
            continue
        row = {"ranks": n, "bytes": nbytes, "count": nbytes // 4, "iters": iters}
        for label, seconds in (("gradsync", our_time), ("raw", raw_time)):
            algbw = nbytes / seconds / 1e9
            row |= {f"{label}_us": round(seconds * 1e6, 3), f"{label}_algbw_gbs": float(f"{algbw:.6g}"),
                    f"{label}_busbw_gbs": float(f"{algbw * 2 * (n - 1) / n:.6g}")}
        row["ratio"] = round(raw_time / our_time, 4)
        rows.append(row)
        print(f"  {nbytes:10d} {nbytes // 4:10d} {iters:6d}"
              + "".join(f" {row[f'{label}_us']:10.1f} {row[f'{label}_algbw_gbs']:8.3f}"
                        f" {row[f'{label}_busbw_gbs']:8.3f}" for label in ("gradsync", "raw"))
              + f" {row['ratio']:7.2f}", flush=True)
    if rank == 0 and args.csv:
        benchenv.write_csv(args.csv, rows, benchenv.environment(n, args.environ))
        print(f"# wrote {args.csv}")


def idle_impact(args: argparse.Namespace, world: MPI.Comm) -> None:
    rank, n = world.Get_rank(), world.Get_size()
    buf = np.zeros(args.idle_bytes // 4, np.float32)
    small = np.zeros(4, np.float32)

    def raw():
        world.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)

    def phase() -> list[float]:
        for _ in range(args.warmup):
            raw()
        return [timed(world, raw) for _ in range(args.iters)]

    def with_idle_gradsync() -> list[float]:
        gradsync.init()
        gradsync.allreduce_(small, name="idle.first", op=gradsync.Sum)  # a cycle, as a real job has
        time.sleep(0.05)  # and back to sleep on its condition variable
        times = phase()
        gradsync.shutdown()
        return times

    phases = {"without gradsync": [], "gradsync idle": []}
    rows = []
    for round_ in range(args.rounds):  # alternate which phase comes first
        order = ("without gradsync", "gradsync idle") if round_ % 2 == 0 else ("gradsync idle",
                                                                                 "without gradsync")
        for label in order:
            times = phase() if label == "without gradsync" else with_idle_gradsync()
            phases[label] += times
            median = slowest_rank_median(world, times)
            if rank == 0:
                rows.append({"ranks": n, "bytes": args.idle_bytes, "round": round_, "phase": label,
                             "iters": args.iters, "median_us": round(median * 1e6, 3)})
                print(f"round {round_}: {label:17s} median {median * 1e3:8.3f} ms", flush=True)
    without = slowest_rank_median(world, phases["without gradsync"])
    idle = slowest_rank_median(world, phases["gradsync idle"])
    if rank != 0:
        return
    ratio = idle / without
    print(f"\nraw mpi4py {format_bytes(args.idle_bytes)} allreduce, {n} ranks, median of "
          f"{args.rounds} rounds x {args.iters} iterations")
    print(f"{'without gradsync':26s} {without * 1e3:8.3f} ms")
    print(f"{'gradsync initialised, idle':26s} {idle * 1e3:8.3f} ms")
    print(f"{'ratio idle / without':26s} {ratio:8.3f}   (allowed: <= {args.idle_limit:.2f}: "
          f"{'yes' if ratio <= args.idle_limit else 'NO'})")
    if args.csv:
        for label, seconds in (("without gradsync", without), ("gradsync idle", idle)):
            rows.append({"ranks": n, "bytes": args.idle_bytes, "round": "all", "phase": label,
                         "iters": args.iters * args.rounds, "median_us": round(seconds * 1e6, 3)})
        benchenv.write_csv(args.csv, rows, benchenv.environment(n, args.environ))
        print(f"# wrote {args.csv}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-bytes", type=parse_bytes, default=8, help="e.g. 8, 4K, 1M")
    parser.add_argument("--max-bytes", type=parse_bytes, default=256 << 20, help="e.g. 64M, 256M")
    parser.add_argument("--factor", type=int, default=2, choices=[2, 4], help="size step")
    parser.add_argument("--iters", type=int, default=200,
                        help="timed iterations per size (fewer for large sizes, see --budget); "
                             "with --idle-impact: per phase")
    parser.add_argument("--min-iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3, help="untimed iterations first")
    parser.add_argument("--budget", type=float, default=2.0,
                        help="seconds of timed calls per size, both implementations together")
    parser.add_argument("--csv", type=str, default=None, help="also write the numbers to this file")
    parser.add_argument("--idle-impact", action="store_true",
                        help="measure gradsync's idle cost on the user's own allreduces instead")
    parser.add_argument("--idle-bytes", type=parse_bytes, default=16 << 20)
    parser.add_argument("--rounds", type=int, default=6, help="--idle-impact: alternating phases")
    parser.add_argument("--idle-limit", type=float, default=1.20, help="--idle-impact: allowed ratio")
    args = parser.parse_args()
    args.environ = dict(os.environ)  # as launched: init() adds OMPI_MCA_mpi_yield_when_idle
    world = MPI.COMM_WORLD
    if args.idle_impact:
        if args.iters == parser.get_default("iters"):
            args.iters = 20
        idle_impact(args, world)
    else:
        gradsync.init()
        sweep(args, world)
        gradsync.shutdown()


if __name__ == "__main__":
    main()
