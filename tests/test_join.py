"""join() for uneven inputs, against a single-process reference: see tests/workers/join_check.py.

The numpy half (every op's stand-in contribution of a joined rank) runs everywhere; the training
half needs torch and runs from the tests marked ``torch``.
"""

import pytest

from mpi_launch import run_mpi

pytestmark = pytest.mark.mpi
ENV = {"GRADSYNC_STALL_CHECK_TIME_SECONDS": "3", "GRADSYNC_STALL_SHUTDOWN_TIME_SECONDS": "10"}


def run_join_check(ranks: int, *args: str, env: dict[str, str]) -> str:
    out = run_mpi("join_check.py", ranks, *args, env={**ENV, **env}, timeout=120).stdout
    assert out.count("join_check rank") == ranks and "passed" in out, out
    return out


@pytest.mark.parametrize("ranks, cache", [(1, "1024"), (2, "1024"), (3, "1024"), (3, "0")])
def test_join_stand_ins_for_every_op(ranks, cache):
    out = run_join_check(ranks, env={"GRADSYNC_CACHE_CAPACITY": cache})
    assert out.count("torch not imported") == ranks, out


@pytest.mark.torch
@pytest.mark.parametrize("ranks", [1, 2, 3])
@pytest.mark.parametrize("divisor", ["size", "contributors"])
def test_join_with_uneven_batches(ranks, divisor):
    run_join_check(ranks, "--torch", env={"GRADSYNC_JOIN_DIVISOR": divisor})


@pytest.mark.torch
def test_join_without_the_response_cache():
    run_join_check(3, "--torch", env={"GRADSYNC_CACHE_CAPACITY": "0"})
