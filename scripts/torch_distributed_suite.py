"""PyTorch's own torch.distributed peer suite (``DistributedTest._DistTestBase`` of the installed
torch's ``torch/testing/_internal/distributed/distributed_test.py``) on the "gradsync" backend, each
MPI rank playing the test process of its rank. scripts/torch_distributed_suite.sh drives it::

    python scripts/torch_distributed_suite.py list [-k EXPR]          # the test names, one a line
    mpiexec -n 2 python scripts/torch_distributed_suite.py run LOG TEST...

Upstream, test/distributed/test_distributed_spawn.py spawns one process per rank for every test
(MultiProcessTestCase) and each process calls ``init_process_group(file://...)``. gradsync takes
rank and size from MPI, so here the ranks of one mpiexec job are those processes: every rank runs
the same tests in the same order, and for each one it starts the default group with
``init_process_group(backend="gradsync", init_method="gradsync://")``, meets the other ranks at
the suite's file barrier (``TEMP_DIR``, shared by the ranks of one machine), runs the test, meets
them again and destroys the group, as upstream's ``TestDistBackend._run`` does.

``run`` appends one line per test to ``LOG.outcomes.<rank>`` as soon as the test ends (name,
outcome, the first line of the error or the skip reason), so a job stopped in a hang keeps the
outcomes of the tests before it. The suite's skips by ``sys.exit(code)`` (``skip_if_lt_x_gpu``,
...) become skips with torch's reason for the code.

The suite skips what a backend does not declare: gradsync is declared a plugin backend with the
"ddp" and "subgroup" features (it runs DDP and new_group on CPU), not "gpu"/"cuda" (CPU tensors only).
Many tests are gated to a backend by name ("Only Gloo backend supports ..."); with ``PEER=gloo``
(or ``PEER=mpi``) those gates, and the test bodies' branches on the backend's name, read as for
that backend, while the tests run on gradsync (torch is given "gradsync"), so gloo's (mpi's) CPU
tests run too.
"""

from __future__ import annotations

import os
import re
import sys
import time
import traceback
import unittest

os.environ.setdefault("BACKEND", "gradsync")
os.environ.setdefault("INIT_METHOD", "gradsync://")
os.environ.setdefault("PYTORCH_PRINT_REPRO_ON_FAILURE", "0")
os.environ.setdefault("WORLD_SIZE", os.environ.get("PMI_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "2")))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.testing._internal import common_distributed  # noqa: E402
from torch.testing._internal.common_utils import TestCase  # noqa: E402

import gradsync.torch  # noqa: E402,F401 - registers the backend and the gradsync:// rendezvous

for feature in ("plugin", "ddp", "subgroup"):
    common_distributed.DistTestCases.backend_feature[feature].add("gradsync")

BACKEND = os.environ["BACKEND"]
#: PEER=gloo or PEER=mpi: the suite's backend gates (decorators, evaluated at import) read as for
#: that backend, so its tests gated to gloo's (or mpi's) CPU features run too, on gradsync.
PEER = os.environ.get("PEER", "")
if PEER:
    os.environ["BACKEND"] = PEER
    _mpi_available, dist.is_mpi_available = dist.is_mpi_available, lambda: True

from torch.testing._internal.distributed import distributed_test as suite  # noqa: E402


class _AsPeer(str):
    """The suite's ``BACKEND`` in its test bodies under PEER: the string "gradsync" (what torch is
    given, ``BACKEND.lower()``), that compares (==, !=, in a set) as equal to PEER, so the bodies'
    branches for the peer (``if BACKEND == "gloo": ...`` builds gloo's CPU model) are taken."""

    def __eq__(self, other: object) -> bool:
        return other == PEER or str.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash(PEER)


if PEER:
    suite.BACKEND = _AsPeer(BACKEND)
    os.environ["BACKEND"] = BACKEND
    dist.is_mpi_available = _mpi_available
_SKIP_CODES = {skip.exit_code: skip.message for skip in common_distributed.TEST_SKIPS.values()}


def _world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


class TestDistBackendGradsync(TestCase, suite.DistributedTest._DistTestBase):
    """The suite's tests, run by every MPI rank of the job on the default group of gradsync."""

    @property
    def rank(self) -> int:
        """This process's rank (MPI's, which is gradsync's)."""
        return _world().Get_rank()

    @property
    def world_size(self) -> str:
        """The number of ranks, as the suite's ``TestDistBackend.world_size`` gives it (a string)."""
        return os.environ["WORLD_SIZE"]

    @property
    def init_method(self) -> str:
        """The rendezvous the suite's tests pass to their own ``init_process_group`` calls."""
        return os.environ["INIT_METHOD"]

    @property
    def destroy_pg_upon_exit(self) -> bool:
        """As upstream's TestDistBackend: the test class destroys the group, not the base class."""
        return False

    def _should_stop_test_suite(self) -> bool:
        return False

    def setUp(self) -> None:
        """A fresh file barrier (rank 0 empties it while the others wait), then the default group."""
        super().setUp()
        self.skip_return_code_checks = []
        _world().Barrier()
        if self.rank == 0:
            for sub in ("barrier", "test_dir"):
                directory = os.path.join(os.environ["TEMP_DIR"], sub)
                for name in os.listdir(directory):
                    os.unlink(os.path.join(directory, name))
        suite.Barrier.barrier_id = 0
        _world().Barrier()
        timeout = suite.CUSTOM_PG_TIMEOUT.get(self._testMethodName, suite.default_pg_timeout)
        from datetime import timedelta

        dist.init_process_group(backend=BACKEND, init_method=self.init_method,
                                timeout=timedelta(seconds=timeout))
        self._barrier()

    def tearDown(self) -> None:
        """Meet the other ranks at the file barrier, then destroy whatever group the test left."""
        try:
            if self._outcome.success:
                self._barrier()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            super().tearDown()

    def _callTestMethod(self, method) -> None:  # noqa: N802 - unittest's name
        try:
            method()
        except SystemExit as exit_:
            if exit_.code in _SKIP_CODES:
                raise unittest.SkipTest(_SKIP_CODES[exit_.code]) from None
            raise


def _matches(expression: str, name: str) -> bool:
    """A pytest-style ``-k`` expression (words, and, or, not, parentheses) on a test's name."""
    def word(match: re.Match) -> str:
        token = match.group(0)
        return token if token in ("and", "or", "not") else repr(token.lower() in name.lower())

    return bool(eval(re.sub(r"[\w\[\]\-.]+", word, expression), {"__builtins__": {}}))  # noqa: S307


def names(expression: str | None = None) -> list[str]:
    """The suite's test names in file order, those matching ``expression`` (``-k``) if given."""
    loader = unittest.TestLoader()
    found = loader.getTestCaseNames(TestDistBackendGradsync)
    order = list(vars(suite.DistributedTest._DistTestBase))
    found = sorted(found, key=lambda n: order.index(n) if n in order else len(order))
    return [n for n in found if expression is None or _matches(expression, n)]


class _Log(unittest.TestResult):
    """Writes each test's outcome to the rank's outcome file as soon as the test ends."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self._path = path
        self._start = 0.0

    def startTest(self, test) -> None:  # noqa: N802
        super().startTest(test)
        self._start = time.monotonic()

    def _write(self, test, outcome: str, why: str = "") -> None:
        why = " ".join(why.split())[:300]
        seconds = time.monotonic() - self._start
        with open(self._path, "a") as out:
            out.write(f"{test._testMethodName}\t{outcome}\t{seconds:.1f}\t{why}\n")

    def addSuccess(self, test) -> None:  # noqa: N802
        super().addSuccess(test)
        self._write(test, "passed")

    def addSkip(self, test, reason) -> None:  # noqa: N802
        super().addSkip(test, reason)
        self._write(test, "skipped", reason)

    def addExpectedFailure(self, test, err) -> None:  # noqa: N802
        super().addExpectedFailure(test, err)
        self._write(test, "passed", "expected failure")

    def addUnexpectedSuccess(self, test) -> None:  # noqa: N802
        super().addUnexpectedSuccess(test)
        self._write(test, "failed", "unexpected success")

    def _error(self, test, err) -> None:
        kind, value, _ = err
        first = (str(value).strip().splitlines() or [""])[0]
        self._write(test, "failed", f"{kind.__name__}: {first}" if first else kind.__name__)
        sys.stderr.write("".join(traceback.format_exception(*err)))

    def addError(self, test, err) -> None:  # noqa: N802
        super().addError(test, err)
        self._error(test, err)

    def addFailure(self, test, err) -> None:  # noqa: N802
        super().addFailure(test, err)
        self._error(test, err)

    def addSubTest(self, test, subtest, err) -> None:  # noqa: N802
        super().addSubTest(test, subtest, err)
        if err is not None:
            self._error(test, err)


def run(log: str, tests: list[str]) -> None:
    """Run ``tests`` in order on this rank, the outcomes into ``log.outcomes.<rank>``."""
    torch.set_num_threads(1)
    result = _Log(f"{log}.outcomes.{_world().Get_rank()}")
    for name in tests:
        sys.stderr.write(f"=== {name}\n")
        TestDistBackendGradsync(name).run(result)
    gradsync.shutdown()


def main(argv: list[str]) -> int:
    """``list [-k EXPR]`` or ``run LOG TEST...`` (see the module)."""
    if argv[:1] == ["list"]:
        expression = argv[2] if argv[1:2] == ["-k"] and len(argv) > 2 else None
        print("\n".join(names(expression)))
        return 0
    if argv[:1] == ["run"] and len(argv) >= 2:
        run(argv[1], argv[2:])
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
