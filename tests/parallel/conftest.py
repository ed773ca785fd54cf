"""Multi-rank tests: every rank of one MPI job runs the same pytest session, test by test.

Run a file of this directory under an MPI launcher, as Horovod's test/parallel and mpi4py's test
suite are run::

    mpiexec -n 2 python -m pytest tests/parallel/test_ops.py
    mpiexec -n 4 python -m pytest "tests/parallel/test_ops.py::test_allreduce_leaves_its_input_alone[int8-Max]"
    mpiexec -n 2 python -m pytest tests/parallel/test_ops.py -k "broadcast and root1"
    mpiexec -n 2 python -m pytest tests/parallel/test_ops.py tests/parallel/test_metrics.py  # one session

``tests/test_parallel.py`` does this for every file here, at the rank counts the file declares in a
module-level ``RANKS = (1, 2, 4)`` (the default), each job under a timeout (``TIMEOUT = 300``
seconds, the default): with ``pytest --full`` each file in a job of its own, in the fast suite the
files of one framework together, in one session per rank count up to 2. Outside a launcher (a
plain ``pytest`` of the whole suite) this directory is not collected: see ``tests/conftest.py``.

A file may also declare *variants*: the same file again, as extra jobs, with more environment
variables (read by ``gradsync.init()``), at other rank counts, on a ``-k`` selection of its
tests::

    VARIANTS = {
        "no-fusion": {"env": {"GRADSYNC_FUSION_THRESHOLD": "0"}, "k": "allreduce"},
        "no-cache": {"env": {"GRADSYNC_CACHE_CAPACITY": "0"}, "ranks": (2, 3)},
    }

``env`` is required; ``ranks`` defaults to ``(2,)``; ``k`` (a pytest ``-k`` expression) to every
test. The job's id is ``<file>-<variant>-<ranks>``, e.g. ``test_ops-no-fusion-2``; to run one by
hand, set the variables yourself:
``GRADSYNC_FUSION_THRESHOLD=0 mpiexec -n 2 python -m pytest tests/parallel/test_ops.py -k allreduce``.

What this conftest guarantees, so that a test reads as a specification of one behaviour:

* gradsync is initialised once per session (``init()`` is collective), with a short stall
  shutdown, so a test whose ranks disagree about which collectives to submit fails with a
  ``StallError`` instead of hanging;
* after every test the ranks compare outcomes (one allreduce on ``COMM_WORLD``): a test that failed
  on any rank fails on every rank, naming the ranks where it failed; so all ranks report the same
  counts and stay in step;
* the fixtures ``rank`` and ``size`` are ``gradsync.rank()`` and ``gradsync.size()``, and ``case``
  is the test's name with its parameters (``test_x[float32-Sum]``): the same on every rank, so it
  serves as the name of the test's collective and as the seed of every rank's input;
* at the end each rank prints one line, ``[parallel] rank R of N: passed=P failed=F skipped=S
  errors=E``, which the launching test parses.

Tests must take the same path on every rank: skip (``pytest.skip``) only on conditions every rank
sees alike, such as ``gradsync.size()``. Run every collective of a test before asserting on its
results where possible, so that a rank whose assertion fails does not leave the others waiting
for a collective it never submits (that would end in a ``StallError`` on them, and a failure of
every later test).
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest

import gradsync  # imported before anything starts MPI: it sets Open MPI's yield setting

# tests/workers: the training of test_training.py is also a script the launch tests run.
sys.path.insert(0, str(Path(__file__).parent.parent / "workers"))

# Before init(): a collective submitted by some ranks only becomes an error on every rank.
os.environ.setdefault("GRADSYNC_STALL_CHECK_TIME_SECONDS", "5")
os.environ.setdefault("GRADSYNC_STALL_SHUTDOWN_TIME_SECONDS", "20")

_FAILED = pytest.StashKey[list]()


def _world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_FAILED] = []


@pytest.fixture(scope="session", autouse=True)
def gradsync_initialised():
    """gradsync running on every rank for the whole session; shut down at its end."""
    gradsync.init()
    yield
    gradsync.shutdown()


@pytest.fixture
def rank() -> int:
    """This process's rank (``gradsync.rank()``)."""
    return gradsync.rank()


@pytest.fixture
def size() -> int:
    """The number of ranks (``gradsync.size()``)."""
    return gradsync.size()


@pytest.fixture
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Rank 0's temporary directory as GRADSYNC_ELASTIC_STATE_DIR on every rank, as the elastic
    driver sets it (tests of gradsync.torch.elastic and gradsync.jax.elastic)."""
    from gradsync.run import store

    directory = gradsync.broadcast_object(str(tmp_path), root_rank=0)
    monkeypatch.setenv(store.STATE_DIR_ENV, directory)
    return Path(directory)


@pytest.fixture
def case(request: pytest.FixtureRequest) -> str:
    """The test's name with its parameters, the same on every rank: a name for its collectives."""
    return request.node.name


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Make each phase's outcome the same on every rank (failed if it failed anywhere)."""
    report = yield
    if call.when == "setup" and report.passed:
        return report  # the call phase follows; compare there
    failed_here = report.failed
    everyone = _world().allgather(failed_here)
    failed_on = [rank for rank, failed in enumerate(everyone) if failed]
    if failed_on and not failed_here:
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} failed on rank(s) {failed_on} (passed on rank "
                           f"{_world().Get_rank()}); see those ranks' output")
    return report


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    stats = reporter.stats if reporter is not None else {}
    counts = {key: len(stats.get(key, [])) for key in ("passed", "failed", "skipped", "error")}
    world = _world()
    line = (f"\n[parallel] rank {world.Get_rank()} of {world.Get_size()}: passed={counts['passed']} "
            f"failed={counts['failed']} skipped={counts['skipped']} errors={counts['error']}\n")
    os.write(1, line.encode())  # one write: lines of different ranks never interleave


@pytest.fixture
def cycle_threads(monkeypatch):
    """The names of the threads that ran this test's negotiation cycles on the global process
    set, in order (the coordinator's ``cycle``, recorded)."""
    coordinator = gradsync.process.runtime.get().coordinator
    names: list[str] = []
    cycle = coordinator.cycle

    def recorded():
        names.append(threading.current_thread().name)
        return cycle()

    monkeypatch.setattr(coordinator, "cycle", recorded)
    return names
