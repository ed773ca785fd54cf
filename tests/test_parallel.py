"""Launch every file of tests/parallel/ as one MPI job per rank count: its tests run on every rank.

A file declares the rank counts it runs at in a module-level ``RANKS = (1, 2, 4)`` (the default)
and, when it needs more than the default 300 s, ``TIMEOUT = <seconds>``. A file that needs torch
sets ``pytestmark = pytest.mark.torch`` (or ``jax``); its jobs are then marked so here too, so they
skip where torch (jax) is not installed. See tests/parallel/conftest.py for what each job guarantees.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from mpi_launch import PARALLEL, mpiexec, run_job, run_parallel

DEFAULT_RANKS = (1, 2, 4)


def _module_setting(path: Path, name: str, default):
    """A literal module-level assignment ``name = ...`` of ``path``, read without importing it."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    return default


def _jobs():
    for path in sorted(PARALLEL.glob("test_*.py")):
        marks = [pytest.mark.mpi]
        for framework in ("torch", "jax"):
            if re.search(rf"^pytestmark\s*=.*pytest\.mark\.{framework}\b", path.read_text(), re.M):
                marks.append(getattr(pytest.mark, framework))
        for n in _module_setting(path, "RANKS", DEFAULT_RANKS):
            yield pytest.param(path, n, id=f"{path.stem}-{n}", marks=marks)


@pytest.mark.parametrize(("path", "n"), list(_jobs()))
def test_file_passes_on_every_rank(path, n):
    counts = run_parallel(path, n, timeout=_module_setting(path, "TIMEOUT", 300))
    assert counts[0]["passed"] > 0, f"{path.name} at {n} ranks ran no test: {counts[0]}"


SELFTEST = PARALLEL / "selftest" / "harness_cases.py"


@pytest.mark.mpi
def test_a_test_that_fails_on_one_rank_fails_on_every_rank():
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "pytest", "-q", "-p",
           "no:cacheprovider", str(SELFTEST)]
    result = run_job(cmd, timeout=120, check=False)
    assert result.returncode == 1, result.stdout
    for rank in (0, 1):
        assert f"[parallel] rank {rank} of 2: passed=2 failed=1 skipped=0 errors=0" in result.stdout
    assert "test_fails_on_the_last_rank_only failed on rank(s) [1] (passed on rank 0)" in result.stdout
    assert "this rank was told to fail" in result.stdout


@pytest.mark.mpi
def test_run_parallel_refuses_a_job_with_a_failure():
    with pytest.raises(AssertionError, match="failed=1"):
        run_parallel(SELFTEST, 2, timeout=120)
