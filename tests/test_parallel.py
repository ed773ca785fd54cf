"""Launch every file of tests/parallel/ as one MPI job per rank count: its tests run on every rank.

A file declares the rank counts it runs at in a module-level ``RANKS = (1, 2, 4)`` (the default)
and, when it needs more than the default 300 s, ``TIMEOUT = <seconds>``. A file that needs torch
sets ``pytestmark = pytest.mark.torch`` (or ``jax``, ``tensorflow``, ``keras``; Lightning's file adds
``lightning``); its jobs are then marked so here too, so they skip where that framework is not
installed; a Keras variant's job also carries the mark of its ``KERAS_BACKEND``. A file's ``VARIANTS`` add jobs with more environment
variables, at their own rank counts, on a ``-k`` selection (the format: tests/parallel/conftest.py).
See tests/parallel/conftest.py for what each job guarantees.

Both suites run the files of one framework (numpy, torch, jax, tensorflow) together, one session
per rank count, so that a job's start-up (MPI, imports; 5-10 s at 4 ranks on 2 cores) is paid once
and not once per file; a variant is a job of its own. The fast suite (``pytest``) runs every file
at its rank counts up to 2 (its smallest one when it has none); of the variants only those of
``FAST_VARIANTS``, one job for each setting a variant exists to test; and the tests that need more
than 2 ranks on a selection of their own (``FAST_ABOVE_2_RANKS``). The full suite (``pytest
--full``, tests/conftest.py) runs every file at each of its rank counts and in each of its
variants; the jobs that the fast suite does not run (3 and 4 ranks, the other variants) are marked
``full``. ``--parallel-files test_ops,test_collectives`` launches only the files named (the Open
MPI pass of .ci/run).
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from mpi_launch import PARALLEL, mpiexec, run_job, run_parallel

DEFAULT_RANKS = (1, 2, 4)
DEFAULT_VARIANT_RANKS = (2,)
FAST_MAX_RANKS = 2
# (file, variant) run by the fast suite: each covers a setting once, on the narrowest selection
# that has it: no response cache, a cache that evicts, no fusion, a threshold that splits a
# fusion, the Average divisor of GRADSYNC_JOIN_DIVISOR=contributors, autotune. The other variants
# repeat these settings on more tests (and run in the full suite).
FAST_VARIANTS = {
    ("test_collectives", "no-cache"),
    ("test_cached_negotiation", "5-entries"),
    ("test_collectives", "no-fusion"),
    ("test_ops", "4k-fusion"),
    ("test_ops", "shared-memory"),
    ("test_optimizer", "join-by-contributors"),
    ("test_training", "autotune"),
    ("test_keras", "jax"),  # the Keras file runs in its backends' variants only (RANKS = ())
    ("test_keras", "torch"),
    ("test_keras", "tensorflow"),
}
# (file, ranks) -> the ``-k`` selection of its tests that run at no count up to 2: a process set
# of two ranks that is not every rank, a number of ranks that is not a power of two. The fast
# suite runs them alone at that count (the full suite runs the whole file there).
FAST_ABOVE_2_RANKS = {
    ("test_adasum", 3): "on_a_process_set or not_a_power_of_two",
    ("test_optimizer", 3): "on_a_process_set_its_first_rank_warns",
}


def _module_setting(path: Path, name: str, default):
    """A literal module-level assignment ``name = ...`` of ``path``, read without importing it."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    return default


@dataclass(frozen=True)
class Job:
    """One MPI job: the files ``paths`` of tests/parallel/ in one pytest session at ``ranks`` ranks,
    with ``env`` added to the environment, running the tests that ``-k select`` picks (all when
    empty)."""

    paths: tuple[Path, ...]
    ranks: int
    env: dict[str, str] = field(default_factory=dict)
    select: str = ""

    def pytest_args(self) -> tuple[str, ...]:
        """The arguments after the first file: the other files, and the selection."""
        return (*map(str, self.paths[1:]), *(("-k", self.select) if self.select else ()))

    def timeout(self) -> float:
        """Seconds the job may run: its files' ``TIMEOUT`` (300 by default), the longest one and
        30 s for each further file."""
        timeouts = [_module_setting(path, "TIMEOUT", 300) for path in self.paths]
        return max(timeouts) + 30 * (len(timeouts) - 1)


def _framework(path: Path) -> str:
    """'tensorflow', 'keras', 'torch' or 'jax' for a file whose ``pytestmark`` marks it so (in
    that order: a Lightning file is marked torch and runs with the torch files); else 'numpy'."""
    for framework in ("tensorflow", "keras", "torch", "jax"):
        if re.search(rf"^pytestmark\s*=.*pytest\.mark\.{framework}\b", path.read_text(), re.M):
            return framework
    return "numpy"


def _marks(framework: str) -> list:
    return [pytest.mark.mpi] + ([getattr(pytest.mark, framework)] if framework != "numpy" else [])


def fast_counts(counts) -> set[int]:
    """The rank counts of ``counts`` that the fast suite runs: those up to 2, else the smallest."""
    return {n for n in counts if n <= FAST_MAX_RANKS} or set(sorted(counts)[:1])


def _variant_jobs(path: Path) -> list[tuple[str, Job, bool]]:
    """(id, job, in the fast suite) for every rank count of every variant the file declares in
    ``VARIANTS``."""
    jobs = []
    for name, variant in _module_setting(path, "VARIANTS", {}).items():
        unknown = set(variant) - {"env", "ranks", "k"}
        assert not unknown and "env" in variant, f"{path.name}: VARIANTS[{name!r}]: {variant}"
        counts = variant.get("ranks", DEFAULT_VARIANT_RANKS)
        fast = fast_counts(counts) if (path.stem, name) in FAST_VARIANTS else set()
        for n in counts:
            job = Job((path,), n, dict(variant["env"]), variant.get("k", ""))
            jobs.append((f"{path.stem}-{name}-{n}", job, n in fast))
    return jobs


def _backend_marks(job: Job) -> list:
    """A Keras job needs its backend's framework too: its torch, jax or tensorflow mark skips it
    where that framework is not installed."""
    backend = job.env.get("KERAS_BACKEND")
    return [getattr(pytest.mark, backend)] if backend in ("torch", "jax", "tensorflow") else []


def _files(config: pytest.Config) -> list[Path]:
    """The files of tests/parallel/ to launch: every ``test_*.py``, or those that
    ``--parallel-files`` names (a comma-separated list of stems, for a CI pass that runs a few
    files under another MPI)."""
    paths = sorted(PARALLEL.glob("test_*.py"))
    chosen = config.getoption("--parallel-files")
    if not chosen:
        return paths
    stems = {stem.strip() for stem in chosen.split(",") if stem.strip()}
    unknown = stems - {path.stem for path in paths}
    if unknown:
        raise pytest.UsageError(f"--parallel-files: no file tests/parallel/<name>.py for {sorted(unknown)}")
    return [path for path in paths if path.stem in stems]


def _grouped_jobs(paths: list[Path], counts_of: Callable[[Path], set[int]]) -> list[tuple[str, Job]]:
    """(id, job): at each rank count that ``counts_of`` gives a file, one job per framework
    running all the files of that framework with that count, in one session: one start-up
    (MPI, imports) instead of one per file."""
    groups: dict[tuple[str, int], list[Path]] = {}
    for path in paths:
        for n in sorted(counts_of(path)):
            groups.setdefault((_framework(path), n), []).append(path)
    return [(f"{framework}-files-{n}", Job(tuple(group), n)) for (framework, n), group in sorted(groups.items())]


def _fast_jobs(paths: list[Path]):
    """At each rank count up to 2 (a file's smallest count, when it has none up to 2), one job
    per framework running all the files of that framework that declare the count, in one session;
    then the variants of FAST_VARIANTS and the selections of FAST_ABOVE_2_RANKS, each a job of its
    own."""
    for job_id, job in _grouped_jobs(paths, lambda path: fast_counts(_module_setting(path, "RANKS", DEFAULT_RANKS))):
        yield pytest.param(job, id=job_id, marks=_marks(_framework(job.paths[0])))
    for path in paths:
        marks = _marks(_framework(path))
        for job_id, job, fast in _variant_jobs(path):
            if fast:
                yield pytest.param(job, id=job_id, marks=[*marks, *_backend_marks(job)])
        for (stem, n), select in FAST_ABOVE_2_RANKS.items():
            if stem == path.stem:
                yield pytest.param(Job((path,), n, select=select), id=f"{stem}-{n}-needing-{n}", marks=marks)


def _full_jobs(paths: list[Path]):
    """At every rank count a file declares, one job per framework running all the files of that
    framework with that count (grouped as in the fast suite: a file's tests are the same wherever
    it runs, and a start-up of 3 or 4 ranks costs 5-10 s on 2 cores), and every variant, each a
    job of its own. The jobs the fast suite runs the same way are unmarked, the others ``full``.
    FAST_ABOVE_2_RANKS's selections are not repeated: their files run whole at those counts."""
    fast = {(job.paths, job.ranks) for _, job in _grouped_jobs(
        paths, lambda path: fast_counts(_module_setting(path, "RANKS", DEFAULT_RANKS)))}
    for job_id, job in _grouped_jobs(paths, lambda path: set(_module_setting(path, "RANKS", DEFAULT_RANKS))):
        marks = _marks(_framework(job.paths[0]))
        in_fast_suite = (job.paths, job.ranks) in fast
        yield pytest.param(job, id=job_id, marks=marks if in_fast_suite else [*marks, pytest.mark.full])
    for path in paths:
        marks = _marks(_framework(path))
        for job_id, job, in_fast_suite in _variant_jobs(path):
            job_marks = [*marks, *_backend_marks(job)]
            yield pytest.param(job, id=job_id, marks=job_marks if in_fast_suite else [*job_marks, pytest.mark.full])


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if metafunc.function is test_file_passes_on_every_rank:
        paths = _files(metafunc.config)
        jobs = _full_jobs(paths) if metafunc.config.getoption("--full") else _fast_jobs(paths)
        metafunc.parametrize("job", [pytest.param(*p.values, id=p.id,
                                                  marks=[*p.marks, pytest.mark.timeout(p.values[0].timeout() + 60)])
                                     for p in jobs])


def test_file_passes_on_every_rank(job):
    counts = run_parallel(job.paths[0], job.ranks, *job.pytest_args(), env=job.env, timeout=job.timeout())
    names = ", ".join(path.name for path in job.paths)
    assert counts[0]["passed"] > 0, f"{names} at {job.ranks} ranks ran no test: {counts[0]}"


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


def test_every_fast_variant_is_declared():
    """A variant renamed or removed must leave FAST_VARIANTS too (or the fast suite silently
    stops covering its setting)."""
    declared = {(path.stem, name) for path in PARALLEL.glob("test_*.py")
                for name in _module_setting(path, "VARIANTS", {})}
    assert FAST_VARIANTS <= declared, FAST_VARIANTS - declared
    files = {path.stem for path in PARALLEL.glob("test_*.py")}
    assert {stem for stem, _ in FAST_ABOVE_2_RANKS} <= files, FAST_ABOVE_2_RANKS
