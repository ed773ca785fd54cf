"""Test-suite wiring: this checkout's src/ first, the fast and the full suite, the ``torch`` and ``jax``
markers, and tests/parallel/.

``pytest`` runs the fast suite, which a contributor runs before every commit: every behaviour once,
at 1 and 2 ranks. ``pytest --full`` also runs the tests marked ``full``: the same behaviours again
at 3 and 4 ranks and in the variants of tests/parallel/ (tests/test_parallel.py decides which of
its jobs are full), under a real SLURM (tests/test_slurm.py), on two hosts
(tests/test_two_hosts.py), and with one MPI's launcher starting the other's Python
(tests/test_foreign_launcher.py), and the slow end-to-end runs whose behaviour the fast suite has
once already: the main example's other modes (sharded optimizer state, the progress bar) and the
Lightning example (tests/test_example.py), the elastic driver's scenarios beyond one restart
(tests/test_elastic.py), a second kind of rank death under torch.distributed, the GPU script's
offline install. A test that starts jobs at several rank counts marks the counts above 2 ``full``, keeping the smallest one in the fast suite when none is 2 or less (a behaviour
that needs 3 ranks). Without ``--full`` the full tests are deselected, not skipped.

``tests/parallel/`` holds multi-rank tests that every rank of an MPI job runs together
(``mpiexec -n N python -m pytest tests/parallel/test_x.py``; see its conftest). A plain pytest run
in one process does not collect them: ``tests/test_parallel.py`` launches each file as such a job.
They are collected when a launcher started this process, or when ``GRADSYNC_PARALLEL_TESTS=1``.

A test that needs PyTorch (directly, or by launching a worker that imports it) carries
``@pytest.mark.torch``; where torch is not installed those tests skip and every other test runs.
Every unmarked test therefore belongs to the numpy-only pass of .ci/run, which sets
``GRADSYNC_TEST_WITHOUT_TORCH=1``. In that mode the session

* stops at once if ``import torch`` succeeds (the pass would prove nothing);
* fails if an unmarked test was skipped because torch is missing (a numpy test hidden behind an
  ``importorskip``: mark it, or split its torch half off);
* fails if fewer than ``GRADSYNC_TEST_MIN_PASSED`` tests passed (when that is set), so that a pass
  which silently stopped running the numpy tests cannot succeed.

Tests that need JAX (and optax) carry ``@pytest.mark.jax`` and skip the same way where jax is not
installed. .ci/run's JAX pass runs ``-m jax`` in a venv with jax but without torch, with
``GRADSYNC_TEST_REQUIRE_JAX=1``: the session stops at once if jax cannot be imported, so that the
pass cannot succeed by skipping.

Tests that need TensorFlow carry ``@pytest.mark.tensorflow`` and skip the same way where it is not
installed; ``GRADSYNC_TEST_REQUIRE_TENSORFLOW=1`` stops the session at once if it cannot be imported
(for a CI pass that runs ``-m tensorflow`` in a venv with TensorFlow and without torch).

Tests that need Ray (tests/test_ray.py) carry ``@pytest.mark.ray`` and skip the same way;
``GRADSYNC_TEST_REQUIRE_RAY=1`` (.ci/run's Ray pass) stops the session if Ray cannot be imported.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "src"))  # this checkout's gradsync

TORCH_INSTALLED = importlib.util.find_spec("torch") is not None
WITHOUT_TORCH = os.environ.get("GRADSYNC_TEST_WITHOUT_TORCH") == "1"
NO_TORCH_REASON = "needs PyTorch, which is not installed (pip install gradsync[torch])"
JAX_INSTALLED = all(importlib.util.find_spec(m) is not None for m in ("jax", "optax"))
NO_JAX_REASON = "needs JAX and optax, which are not installed (pip install gradsync[jax])"
LIGHTNING_INSTALLED = all(importlib.util.find_spec(m) is not None for m in ("lightning", "torchmetrics"))
NO_LIGHTNING_REASON = "needs Lightning and torchmetrics, which are not installed (pip install gradsync[lightning])"
KERAS_INSTALLED = importlib.util.find_spec("keras") is not None
NO_KERAS_REASON = "needs Keras 3, which is not installed (pip install gradsync[keras])"
TENSORFLOW_INSTALLED = importlib.util.find_spec("tensorflow") is not None
NO_TENSORFLOW_REASON = "needs TensorFlow, which is not installed (pip install gradsync[tensorflow])"
RAY_INSTALLED = importlib.util.find_spec("ray") is not None
NO_RAY_REASON = "needs Ray, which is not installed (pip install gradsync[ray])"
PARALLEL = Path(__file__).parent / "parallel"
# Set by mpiexec (Hydra, Open MPI) and srun --mpi=pmi2|pmix in every process they start.
_LAUNCHER_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")


def _under_a_launcher() -> bool:
    return (os.environ.get("GRADSYNC_PARALLEL_TESTS") == "1"
            or any(v in os.environ for v in _LAUNCHER_VARIABLES))


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if collection_path == PARALLEL or PARALLEL in collection_path.parents:
        return None if _under_a_launcher() else True
    return None


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--full", action="store_true",
                     help="gradsync: also run the tests marked full (3 and 4 ranks, the variants of "
                          "tests/parallel, SLURM, two hosts, foreign launchers); see tests/conftest.py")
    parser.addoption("--parallel-files", default="",
                     help="gradsync: launch only these files of tests/parallel (comma-separated stems, "
                          "e.g. test_ops,test_collectives); see tests/test_parallel.py")


def pytest_configure(config: pytest.Config) -> None:
    if WITHOUT_TORCH:
        try:
            import torch  # noqa: F401
        except ImportError:
            pass
        else:
            pytest.exit("GRADSYNC_TEST_WITHOUT_TORCH=1 but `import torch` works here: "
                        "run the numpy-only pass in an environment without torch", returncode=4)
    if os.environ.get("GRADSYNC_TEST_REQUIRE_JAX") == "1" and not JAX_INSTALLED:
        pytest.exit(f"GRADSYNC_TEST_REQUIRE_JAX=1, but the tests marked jax would skip: {NO_JAX_REASON}",
                    returncode=4)
    if os.environ.get("GRADSYNC_TEST_REQUIRE_TENSORFLOW") == "1" and not TENSORFLOW_INSTALLED:
        pytest.exit("GRADSYNC_TEST_REQUIRE_TENSORFLOW=1, but the tests marked tensorflow would skip: "
                    f"{NO_TENSORFLOW_REASON}", returncode=4)
    if os.environ.get("GRADSYNC_TEST_REQUIRE_RAY") == "1" and not RAY_INSTALLED:
        pytest.exit(f"GRADSYNC_TEST_REQUIRE_RAY=1, but the tests marked ray would skip: {NO_RAY_REASON}",
                    returncode=4)
    config.stash[_SKIPPED_FOR_TORCH] = []


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--full"):
        full = [item for item in items if item.get_closest_marker("full")]
        if full:
            config.hook.pytest_deselected(items=full)
            items[:] = [item for item in items if not item.get_closest_marker("full")]
    for marker, installed, reason in (("torch", TORCH_INSTALLED, NO_TORCH_REASON),
                                      ("jax", JAX_INSTALLED, NO_JAX_REASON),
                                      ("lightning", LIGHTNING_INSTALLED, NO_LIGHTNING_REASON),
                                      ("keras", KERAS_INSTALLED, NO_KERAS_REASON),
                                      ("tensorflow", TENSORFLOW_INSTALLED, NO_TENSORFLOW_REASON),
                                      ("ray", RAY_INSTALLED, NO_RAY_REASON)):
        if installed:
            continue
        skip = pytest.mark.skip(reason=reason)
        for item in items:
            if item.get_closest_marker(marker):
                item.add_marker(skip)


_SKIPPED_FOR_TORCH = pytest.StashKey[list]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if (WITHOUT_TORCH and report.skipped and not item.get_closest_marker("torch")
            and "torch" in str(report.longrepr)):
        item.config.stash[_SKIPPED_FOR_TORCH].append(f"{item.nodeid}: {report.longrepr}")
    return report


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not WITHOUT_TORCH:
        return
    problems = [f"unmarked test skipped for want of torch (mark it @pytest.mark.torch, or split "
                f"its torch part off): {line}" for line in session.config.stash[_SKIPPED_FOR_TORCH]]
    minimum = int(os.environ.get("GRADSYNC_TEST_MIN_PASSED", "0"))
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    passed = len(reporter.stats.get("passed", [])) if reporter is not None else 0
    if passed < minimum:
        problems.append(f"only {passed} tests passed without torch; GRADSYNC_TEST_MIN_PASSED={minimum}")
    if problems:
        for problem in problems:
            print(f"\nnumpy-only pass: {problem}", file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
