"""Shared by the benchmark scripts: the environment to state next to every figure, and CSV files
that carry it.

Step times and bandwidths move with the MPI library, the number of ranks per core and glibc's malloc
settings (docs/performance-notes.md, fact 9: the single-process step is 75 ms by default, 51 ms with
``MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=-1``), so every CSV starts with ``# key: value`` lines
that record them, and docs/benchmarks.md prints them beside each table.
"""

from __future__ import annotations

import csv
import importlib.metadata
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

# Variables that change the figures; each is recorded, "unset" when absent.
RECORDED_VARIABLES = ("OMP_NUM_THREADS", "MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX",
                      "OMPI_MCA_mpi_yield_when_idle")


def mpi_library() -> str:
    """The first line of MPI_Get_library_version, without initialising MPI if it is not yet."""
    if "mpi4py.MPI" not in sys.modules:
        import mpi4py

        mpi4py.rc.initialize = False  # this process only asks for the version string
    from mpi4py import MPI

    # Open MPI ends the string with a NUL byte, which would make the CSV files binary to grep.
    return " ".join(MPI.Get_library_version().replace("\0", "").splitlines()[0].replace("Version:", "").split())


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _git_revision() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + (" (uncommitted changes)" if dirty else "")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def environment(ranks: int, environ: dict[str, str] | None = None) -> dict[str, str]:
    """What to state next to a figure: MPI, ranks, cores, malloc and thread settings, versions.

    ``environ`` is the environment the measured processes ran with (default: this process's).
    """
    environ = os.environ if environ is None else environ
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    info = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "mpi": mpi_library(),
        "ranks": str(ranks),
        "cores": str(cores),
        "cpu": _cpu_model(),
        "python": platform.python_version(),
        "numpy": _version("numpy"),
        "mpi4py": _version("mpi4py"),
        "torch": _version("torch"),
        "gradsync": f"{_version('gradsync')}, git {_git_revision()}",
    }
    for package in ("jax", "jaxlib", "optax"):  # benchmarks/jax_step.py; absent from the others' files
        if _version(package) != "not installed":
            info[package] = _version(package)
    for variable in RECORDED_VARIABLES:
        info[variable] = environ.get(variable, "unset")
    for variable in sorted(v for v in environ if v.startswith("GRADSYNC_")):
        info[variable] = environ[variable]
    return info


#: The label suffix of the rows that run another version's gradsync (``--baseline-src``).
BASELINE = "baseline"
BASELINE_HELP = ("--compare: add the gradsync rows again with the gradsync package of this directory "
                 "(another version's src/, e.g. `git archive main src | tar -x -C /tmp/main`, then "
                 "/tmp/main/src) first on PYTHONPATH: before and after, interleaved in one run")


def with_baseline(env: dict[str, str], label: str, src: str | None) -> dict[str, str]:
    """``env`` for the launch of the row ``label``: with ``src`` first on ``PYTHONPATH`` if the
    row is a baseline row (:data:`BASELINE` in its label)."""
    if not src or BASELINE not in label:
        return env
    path = os.path.abspath(src)
    return dict(env, PYTHONPATH=os.pathsep.join(p for p in (path, env.get("PYTHONPATH")) if p))


def print_step_medians(step: Callable[[], object], steps: int, warmup: int, rank: int) -> None:
    """Run ``step()`` ``warmup + steps`` times; on rank 0 print the medians of the timed steps'
    wall and CPU time (all the process's threads) as ``median_step_us=<us> median_cpu_us=<us>``,
    the line :func:`launch_measured` reads."""
    times, cpu = [], []
    for i in range(warmup + steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
    if rank == 0:
        print(f"median_step_us={statistics.median(times) * 1e6:.1f} "
              f"median_cpu_us={statistics.median(cpu) * 1e6:.1f}", flush=True)


def launch_measured(cmd: list[str], processes: int, env: dict[str, str],
                    breakdown: dict[str, float] | None = None) -> tuple[float, float]:
    """Run ``cmd``, a step benchmark that prints ``median_step_us=<us> median_cpu_us=<us>``
    (rank 0 of an MPI job): under ``mpiexec -n processes`` when ``processes > 1``, as
    ``-processes`` independent copies at once when ``processes < 0`` (the floor). Returns the two
    medians, the copies' means. Exits with the output of a launch that printed no figures.
    ``breakdown``, if given, receives the fields of a ``breakdown_us part=<us> ...`` line
    (benchmarks/breakdown.py) when the launch printed one."""
    if processes > 1:
        cmd = [os.path.join(os.path.dirname(sys.executable), "mpiexec"), "-n", str(processes), *cmd]
    runs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            for _ in range(max(1, -processes))]
    values = []
    for run in runs:
        out, err = run.communicate(timeout=900)
        line = [x for x in out.splitlines() if x.startswith("median_step_us=")]
        if not line:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{out}\n{err[-4000:]}")
        values.append([float(field.split("=")[1]) for field in line[0].split()])
        parts = [x for x in out.splitlines() if x.startswith("breakdown_us ")]
        if breakdown is not None and parts:
            breakdown.update((k, float(v)) for k, v in (f.split("=") for f in parts[0].split()[1:]))
    return sum(v[0] for v in values) / len(values), sum(v[1] for v in values) / len(values)


def malloc_summary(env: dict[str, str]) -> str:
    """'glibc default' or the malloc variables that were set, for a one-line statement."""
    tuned = [f"{v}={env[v]}" for v in ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX")
             if env.get(v, "unset") != "unset"]
    return " ".join(tuned) if tuned else "glibc default"


def write_csv(path: str, rows: list[dict], env: dict[str, str]) -> None:
    """Write ``rows`` (dicts with the same keys) to ``path``, after ``# key: value`` environment lines."""
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    with open(path, "w", newline="") as f:
        for key, value in env.items():
            f.write(f"# {key}: {value}\n")
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def read_csv(path: str) -> tuple[dict[str, str], list[dict[str, str]]]:
    """The environment and the rows of a file written by :func:`write_csv` (values as strings)."""
    env: dict[str, str] = {}
    with open(path, newline="") as f:
        lines = f.read().splitlines()
    body = []
    for line in lines:
        if line.startswith("# "):
            key, _, value = line[2:].partition(": ")
            env[key] = value
        elif line:
            body.append(line)
    return env, list(csv.DictReader(body))
