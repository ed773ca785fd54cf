"""Process sets: DistributedOptimizer on sets and compression (tests/workers/toolkit_optimizer_check.py),
and a name submitted on different sets. The collectives on sets: tests/parallel/test_process_sets.py."""

import re

import pytest

from mpi_launch import run_mpi

pytestmark = pytest.mark.mpi


@pytest.mark.torch
@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_optimizer_with_process_sets_and_compression(ranks):
    out = run_mpi("toolkit_optimizer_check.py", ranks, timeout=180).stdout
    assert out.count("toolkit_optimizer_check rank") == ranks, out


def test_name_submitted_on_different_sets_is_reported():
    env = {"GRADSYNC_STALL_CHECK_TIME_SECONDS": "1", "GRADSYNC_STALL_SHUTDOWN_TIME_SECONDS": "3"}
    out = run_mpi("process_set_mismatch.py", 3, env=env, timeout=120, check=False).stdout
    times = [float(t) for t in re.findall(r"StallError after (\d+\.\d) s", out)]
    assert len(times) == 3, out
    assert max(times) < 15, out
