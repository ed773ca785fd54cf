"""Self-check of an installation and a launch: ``python -m gradsync.check``.

Run it alone, or under the launcher you train with, with the same options::

    python -m gradsync.check
    mpiexec -n 4 python -m gradsync.check
    srun --mpi=pmix -n 8 python -m gradsync.check

Rank 0 prints the MPI library and version, the launcher detected, and, when the two cannot work
together, a FAIL line before MPI is started (:func:`gradsync.process.launch.diagnose`); then the thread
level, the rank layout per host (local and cross ranks, GPUs), whether NCCL, CuPy and torch are
available, then runs a small allreduce, broadcast and allgather against the expected values and a
bandwidth probe, and ends with ``PASS`` or ``FAIL: <reason>`` (exit status 0 or 1). Missing NCCL,
CuPy or torch are reported, never a failure. A watchdog aborts the job with a FAIL line if a rank gets stuck.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import platform
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

KEY_WIDTH = 14
#: Seconds a rank that prints nothing waits before exiting from a failed launch (see unlaunched_verdict).
QUIET_EXIT_DELAY = 5.0
THREAD_LEVELS = ("MPI_THREAD_SINGLE", "MPI_THREAD_FUNNELED", "MPI_THREAD_SERIALIZED",
                 "MPI_THREAD_MULTIPLE")


@dataclasses.dataclass(frozen=True)
class RankInfo:
    """What one rank knows about where it runs; rank 0 gathers these for the layout."""

    rank: int
    host: str
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    gpus: int


class Watchdog:
    """Aborts the job with a FAIL line if the check makes no progress for ``timeout`` seconds."""

    def __init__(self, timeout: float, rank: int) -> None:
        self.timeout, self.rank, self.phase = timeout, rank, "starting"
        self._timer: threading.Timer | None = None

    def enter(self, phase: str) -> None:
        self.cancel()
        self.phase = phase
        self._timer = threading.Timer(self.timeout, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _fire(self) -> None:
        sys.stdout.write(f"FAIL: rank {self.rank}: no progress for {self.timeout:.0f} s while "
                         f"{self.phase}: a rank is stuck or missing (network interface, firewall, "
                         "or a rank that died); aborting the job\n")
        sys.stdout.flush()
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)


# ---- libraries -----------------------------------------------------------------------------------

def nccl_status() -> tuple[str, list[str]]:
    """The NCCL that gradsync loads (:func:`gradsync.backends.nccl_api.load_library`: GRADSYNC_NCCL_LIBRARY,
    one already loaded by torch, the nvidia-nccl-cu12/cu13 wheels, the system): its version and file, or
    "not found", plus the places that failed for a reason other than plain absence. Never raises."""
    try:
        from gradsync.backends import nccl_api as nccl

        library = nccl.load_library()
    except Exception as exc:  # noqa: BLE001 - NcclUnavailableError, or a broken binding
        tried = [line.strip()[2:] for line in str(exc).splitlines() if line.strip().startswith("- ")]
        absent = ("not set", "not installed", "found nothing", "cannot open shared object file",
                  "in this process: none")
        problems = [t for t in tried if not any(marker in t for marker in absent)]
        if not tried:
            problems = [f"{type(exc).__name__}: {exc}"]
        return ("not found (pip install gradsync[nccl-cu12] for CUDA 12, gradsync[nccl-cu13] for "
                "CUDA 13, or set GRADSYNC_NCCL_LIBRARY)", problems)
    return f"{'.'.join(map(str, library.version))} ({library.path}, {library.source})", []


def cupy_status() -> tuple[str, int]:
    """CuPy's version and GPU count, or why there is none. Never raises."""
    if importlib.util.find_spec("cupy") is None:
        return "not installed", 0
    try:
        import cupy
    except Exception as exc:  # noqa: BLE001 - a broken install is a finding, not a crash
        return f"installed but import fails: {type(exc).__name__}: {exc}", 0
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001
        return f"{cupy.__version__}, no usable GPU ({type(exc).__name__}: {exc})", 0
    return f"{cupy.__version__}, {count} GPU(s)", count


def torch_status() -> tuple[str, int]:
    """torch's version, CUDA and NCCL build, GPU count. Never raises."""
    if importlib.util.find_spec("torch") is None:
        return "not installed", 0
    try:
        import torch
    except Exception as exc:  # noqa: BLE001
        return f"installed but import fails: {type(exc).__name__}: {exc}", 0
    if torch.version.cuda is None:
        return f"{torch.__version__}, CPU-only build (no CUDA)", 0
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # noqa: BLE001
        nccl = "none"
    return f"{torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}, {count} GPU(s)", count


# ---- layout --------------------------------------------------------------------------------------

def ranges(numbers: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    parts: list[str] = []
    for n in sorted(numbers):
        if parts and parts[-1][1] == n - 1:
            parts[-1] = (parts[-1][0], n)
        else:
            parts.append((n, n))
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in parts)


def layout(infos: list[RankInfo], max_hosts: int = 16) -> tuple[list[str], list[str]]:
    """Lines describing the ranks per host, and warnings about the layout."""
    hosts: dict[str, list[RankInfo]] = {}
    for info in sorted(infos, key=lambda i: i.rank):
        hosts.setdefault(info.host, []).append(info)
    lines, warnings = [], []
    width = max(len(h) for h in hosts)
    for host, members in list(hosts.items())[:max_hosts]:
        crosses = sorted({m.cross_rank for m in members if m.local_rank == 0})
        gpus = max(m.gpus for m in members)
        lines.append(f"  {host:<{width}}  ranks {ranges([m.rank for m in members])}, local_rank "
                     f"{ranges([m.local_rank for m in members])} of {members[0].local_size}, "
                     f"cross_rank {ranges(crosses) or '?'}, {gpus} GPU(s)")
        if sorted(m.local_rank for m in members) != list(range(len(members))) or \
                any(m.local_size != len(members) for m in members):
            warnings.append(f"host {host}: MPI's shared-memory grouping (local_rank/local_size) "
                            "differs from the host names: two hosts with one name, or containers?")
        if 0 < gpus < len(members):
            warnings.append(
                f"host {host}: {len(members)} ranks but {gpus} GPU(s): "
                "torch.cuda.set_device(gradsync.local_rank()) fails for local_rank >= "
                f"{gpus}, and NCCL refuses two ranks on one GPU; start {gpus} rank(s) per host")
    if len(hosts) > max_hosts:
        lines.append(f"  ... and {len(hosts) - max_hosts} more hosts")
    return lines, warnings


# ---- collectives ---------------------------------------------------------------------------------

def check_collectives(gs: Any, rank: int, size: int) -> list[str]:
    """A small allreduce (sum, average, max), broadcast and allgather; the problems found."""
    problems = []
    x = np.arange(1000, dtype=np.float64) * (rank + 1)
    cases: list[tuple[str, Callable[[], Any], np.ndarray]] = [
        ("float64 sum allreduce", lambda: gs.allreduce(x, name="check.sum", op=gs.Sum),
         np.arange(1000, dtype=np.float64) * (size * (size + 1) // 2)),
        ("float32 average allreduce",
         lambda: gs.allreduce(np.full(7, rank, np.float32), name="check.average"),
         np.full(7, (size - 1) / 2, np.float32)),
        ("int32 max allreduce",
         lambda: gs.allreduce(np.array([rank], np.int32), name="check.max", op=gs.Max),
         np.array([size - 1], np.int32)),
        ("broadcast", lambda: gs.broadcast(np.full(3, rank, np.int64), size - 1, name="check.bcast"),
         np.full(3, size - 1, np.int64)),
        ("allgather", lambda: gs.allgather(np.array([rank], np.int64), name="check.gather"),
         np.arange(size, dtype=np.int64)),
    ]
    for what, run, expected in cases:
        try:
            got = np.asarray(run())
        except Exception as exc:  # noqa: BLE001 - report it, keep the other ranks in step
            problems.append(f"rank {rank}: {what} raised {type(exc).__name__}: {exc}")
            continue
        if got.shape != expected.shape or not np.allclose(got, expected):
            problems.append(f"rank {rank}: {what} returned {got[:4]}..., expected {expected[:4]}...")
    return problems


def bandwidth_probe(gs: Any, size: int, mib: float, iterations: int) -> tuple[float, list[str]]:
    """Median seconds per allreduce of ``mib`` MiB of float32 through gradsync, and problems."""
    buffer = np.ones(max(1, int(mib * (1 << 20)) // 4), np.float32)
    times = []
    for i in range(iterations + 1):  # the first call allocates and negotiates: not timed
        buffer.fill(1.0)
        start = time.perf_counter()
        gs.allreduce_(buffer, name="check.bandwidth", op=gs.Sum)
        times.append(time.perf_counter() - start)
        if not (buffer[0] == size and buffer[-1] == size):
            return 0.0, [f"bandwidth probe, call {i}: the sum of ones is {buffer[0]}, not {size}"]
    return float(np.median(times[1:])), []


# ---- the report ----------------------------------------------------------------------------------

class Report:
    """Prints aligned ``key  value`` lines on rank 0 only."""

    def __init__(self, printing: bool) -> None:
        self.printing = printing

    def line(self, key: str, value: str) -> None:
        if self.printing:
            print(f"{key:<{KEY_WIDTH}} {value}", flush=True)

    def raw(self, text: str) -> None:
        if self.printing:
            print(text, flush=True)


def verdict(report: Report, warnings: list[str], problems: list[str]) -> int:
    for warning in warnings:
        report.raw(f"WARNING: {warning}")
    if problems:
        for problem in problems:
            report.raw(f"FAIL: {problem}")
        return 1
    report.raw("PASS")
    return 0


def unlaunched_verdict(report: Report, problem: str) -> int:
    """FAIL for a launch whose processes cannot talk to each other. The launcher's rank 0 prints; the
    others wait before they exit, since a launcher ends the whole job at the first failed exit and
    would cut rank 0's report short (rank 0's own exit ends them sooner)."""
    status = verdict(report, [], [problem])
    if not report.printing:
        time.sleep(QUIET_EXIT_DELAY)
    return status


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m gradsync.check", description=__doc__.split("\n")[0])
    parser.add_argument("--probe-mib", type=float, default=16.0,
                        help="size of the bandwidth probe's allreduce in MiB (default 16)")
    parser.add_argument("--iterations", type=int, default=5,
                        help="timed allreduces in the bandwidth probe (default 5)")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="abort with FAIL when a step takes longer, in seconds (default 60)")
    return parser.parse_args(argv)


def describe_library(report: Report, gs: Any, MPI: Any, library: Any) -> None:
    """Report gradsync, Python and the MPI library; all known before ``MPI_Init``."""
    report.line("gradsync", f"{gs.__version__} on Python {platform.python_version()} ({sys.executable})")
    report.line("MPI library", " ".join(MPI.Get_library_version().replace("\0", "").split("\n")[0].split()))
    report.line("MPI", f"{library.name} {library.version}, standard "
                       f"{'.'.join(map(str, MPI.Get_version()))}, mpi4py "
                       f"{importlib.import_module('mpi4py').__version__}"
                       + (f", {library.path}" if library.path else ""))


def describe_launch(report: Report, MPI: Any, launcher: Any, library: Any) -> str | None:
    """Report the thread level and the launcher once MPI runs; the launcher/MPI mismatch, if any."""
    from gradsync.process.launch import launcher_mismatch

    world = MPI.COMM_WORLD
    level = MPI.Query_thread()
    report.line("thread level", THREAD_LEVELS[level] if 0 <= level < 4 else str(level))
    started = f", started {launcher.expected_size} processes" if launcher.expected_size else ""
    report.line("launcher", f"{launcher.name}{started}; MPI world size {world.Get_size()}")
    return launcher_mismatch(launcher, world.Get_size(), library)


def describe_layout(report: Report, gs: Any, watchdog: Watchdog) -> list[str]:
    """Report the allreduce mode, the ranks per host and the GPU libraries; layout warnings."""
    from gradsync.process import runtime

    report.line("allreduce", runtime.get().backend.describe())
    watchdog.enter("probing libraries")
    torch_text, torch_gpus = torch_status()
    cupy_text, cupy_gpus = cupy_status()
    nccl_text, nccl_problems = nccl_status()
    me = RankInfo(gs.rank(), socket.gethostname(), gs.local_rank(), gs.local_size(),
                  gs.cross_rank(), gs.cross_size(), max(torch_gpus, cupy_gpus))
    watchdog.enter("gathering the rank layout (allgather_object)")
    infos = gs.allgather_object(me, name="check.layout")
    lines, warnings = layout(infos)
    report.line("hosts", f"{len({i.host for i in infos})} host(s), {gs.size()} rank(s)")
    for text in lines:
        report.raw(text)
    report.line("NCCL", nccl_text)
    for problem in nccl_problems:
        report.raw(f"{'':<{KEY_WIDTH}}   {problem}")
    report.line("CuPy", cupy_text)
    report.line("torch", torch_text)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    report.line("GPUs", f"{me.gpus} on this host (rank 0)"
                + (f", CUDA_VISIBLE_DEVICES={visible}" if visible is not None else ""))
    return warnings


def run_collectives(report: Report, gs: Any, watchdog: Watchdog, args: argparse.Namespace) -> list[str]:
    """Run the small collectives and the bandwidth probe; every rank's problems."""
    rank, size = gs.rank(), gs.size()
    watchdog.enter("running the small collectives")
    problems = check_collectives(gs, rank, size)
    watchdog.enter(f"running the bandwidth probe ({args.probe_mib:g} MiB allreduce)")
    seconds, probe_problems = bandwidth_probe(gs, size, args.probe_mib, args.iterations)
    watchdog.enter("gathering the results")
    problems = [p for rank_problems in gs.allgather_object(problems + probe_problems,
                                                           name="check.problems")
                for p in rank_problems]
    slowest = max(gs.allgather_object(seconds, name="check.seconds"))
    if not problems:
        report.line("collectives", f"allreduce (sum, average, max), broadcast, allgather on {size} "
                                   "rank(s): results as expected")
    if slowest > 0:
        algbw = args.probe_mib * (1 << 20) / slowest / 1e9
        bus = (f", bus bandwidth {algbw * 2 * (size - 1) / size:.2f} GB/s" if size > 1
               else " (one rank: nothing crosses a link)")
        report.line("bandwidth", f"{args.probe_mib:g} MiB float32 allreduce: {slowest * 1e3:.2f} ms "
                                 f"(median of {args.iterations}, slowest rank), algorithm bandwidth "
                                 f"{algbw:.2f} GB/s{bus}")
    return problems


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import gradsync as gs
    from gradsync.process import launch

    # Before MPI runs, only the launcher knows the ranks: its rank 0 alone prints, as rank 0 does later.
    launcher = launch.detect_launcher()
    report = Report(launcher.rank in (None, 0))
    MPI = launch.import_mpi()
    library = launch.mpi_library(MPI)
    describe_library(report, gs, MPI, library)
    try:
        launch.start_mpi()
    except gs.GradsyncError as exc:
        started = f", started {launcher.expected_size} processes" if launcher.expected_size else ""
        report.line("launcher", f"{launcher.name}{started}; MPI not started")
        return unlaunched_verdict(report, str(exc))
    if MPI.COMM_WORLD.Get_size() > 1:
        report = Report(MPI.COMM_WORLD.Get_rank() == 0)
    mismatch = describe_launch(report, MPI, launcher, library)
    if mismatch:
        return unlaunched_verdict(report, mismatch)
    watchdog = Watchdog(args.timeout, MPI.COMM_WORLD.Get_rank())
    watchdog.enter("in gradsync.init()")
    try:
        gs.init()
    except gs.GradsyncError as exc:
        watchdog.cancel()
        return verdict(report, [], [str(exc)])
    try:
        warnings = describe_layout(report, gs, watchdog)
        problems = run_collectives(report, gs, watchdog, args)
        watchdog.enter("shutting down")
        gs.shutdown()
    except Exception:  # noqa: BLE001 - one rank failed: end the job rather than hang the others
        print(f"FAIL: rank {MPI.COMM_WORLD.Get_rank()}: {traceback.format_exc()}", flush=True)
        MPI.COMM_WORLD.Abort(1)
    watchdog.cancel()
    return verdict(report, warnings, problems)


if __name__ == "__main__":
    sys.exit(main())
