"""Launch every file of tests/parallel/ as one MPI job per rank count: its tests run on every rank.

A file declares the rank counts it runs at in a module-level ``RANKS = (1, 2, 4)`` (the default)
and, when it needs more than the default 300 s, ``TIMEOUT = <seconds>``. A file that needs torch
sets ``pytestmark = pytest.mark.torch`` (or ``jax``, or a list with ``lightning``); its jobs are then marked so here too, so they
skip where torch (jax) is not installed. A file's ``VARIANTS`` add jobs with more environment
variables, at their own rank counts, on a ``-k`` selection (the format: tests/parallel/conftest.py).
See tests/parallel/conftest.py for what each job guarantees.
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from mpi_launch import PARALLEL, mpiexec, run_job, run_parallel

DEFAULT_RANKS = (1, 2, 4)
DEFAULT_VARIANT_RANKS = (2,)


def _module_setting(path: Path, name: str, default):
    """A literal module-level assignment ``name = ...`` of ``path``, read without importing it."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    return default


@dataclass(frozen=True)
class Job:
    """One MPI job: a file of tests/parallel/ at ``ranks`` ranks, with ``env`` added to the
    environment, running the tests that ``-k select`` picks (all when empty)."""

    path: Path
    ranks: int
    env: dict[str, str] = field(default_factory=dict)
    select: str = ""

    def pytest_args(self) -> tuple[str, ...]:
        return ("-k", self.select) if self.select else ()


def _variant_jobs(path: Path) -> list[tuple[str, Job]]:
    """(id, job) for every rank count of every variant the file declares in ``VARIANTS``."""
    jobs = []
    for name, variant in _module_setting(path, "VARIANTS", {}).items():
        unknown = set(variant) - {"env", "ranks", "k"}
        assert not unknown and "env" in variant, f"{path.name}: VARIANTS[{name!r}]: {variant}"
        for n in variant.get("ranks", DEFAULT_VARIANT_RANKS):
            job = Job(path, n, dict(variant["env"]), variant.get("k", ""))
            jobs.append((f"{path.stem}-{name}-{n}", job))
    return jobs


def _jobs():
    for path in sorted(PARALLEL.glob("test_*.py")):
        marks = [pytest.mark.mpi]
        for framework in ("torch", "jax", "lightning", "keras", "tensorflow"):
            if re.search(rf"^pytestmark\s*=.*pytest\.mark\.{framework}\b", path.read_text(), re.M):
                marks.append(getattr(pytest.mark, framework))
        plain = [(f"{path.stem}-{n}", Job(path, n)) for n in _module_setting(path, "RANKS", DEFAULT_RANKS)]
        for job_id, job in plain + _variant_jobs(path):
            # A Keras job needs its backend's framework too: its torch, jax or tensorflow mark skips it without.
            backend = job.env.get("KERAS_BACKEND")
            extra = [getattr(pytest.mark, backend)] if backend in ("torch", "jax", "tensorflow") else []
            yield pytest.param(job, id=job_id, marks=marks + extra)


@pytest.mark.parametrize("job", list(_jobs()))
def test_file_passes_on_every_rank(job):
    counts = run_parallel(job.path, job.ranks, *job.pytest_args(), env=job.env,
                          timeout=_module_setting(job.path, "TIMEOUT", 300))
    assert counts[0]["passed"] > 0, f"{job.path.name} at {job.ranks} ranks ran no test: {counts[0]}"


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


def test_no_file_of_tests_parallel_has_the_name_of_a_file_of_tests():
    """pytest imports test files by their base name (there is no __init__.py): two files of one
    name would break a session that collects both (GRADSYNC_PARALLEL_TESTS=1)."""
    names = {path.name for path in PARALLEL.glob("test_*.py")}
    assert not names & {path.name for path in PARALLEL.parent.glob("test_*.py")}
