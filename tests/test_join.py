"""join() for uneven inputs, against a single-process reference: see tests/workers/join_check.py."""

import pytest

from mpi_launch import run_mpi

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("ranks", [1, 2, 3])
@pytest.mark.parametrize("divisor", ["size", "contributors"])
def test_join_with_uneven_batches(ranks, divisor):
    env = {"GRADSYNC_JOIN_DIVISOR": divisor,
           "GRADSYNC_STALL_CHECK_TIME_SECONDS": "3", "GRADSYNC_STALL_SHUTDOWN_TIME_SECONDS": "10"}
    out = run_mpi("join_check.py", ranks, env=env, timeout=120).stdout
    assert out.count("join_check rank") == ranks and "passed" in out, out


def test_join_without_the_response_cache():
    out = run_mpi("join_check.py", 3, env={"GRADSYNC_CACHE_CAPACITY": "0"}, timeout=120).stdout
    assert out.count("join_check rank") == 3, out
