"""Process sets against numpy references: see tests/workers/process_set_check.py and
tests/workers/toolkit_optimizer_check.py."""

import pytest

from mpi_launch import run_mpi

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_process_sets(ranks):
    out = run_mpi("process_set_check.py", ranks, timeout=180).stdout
    assert out.count("process_set_check rank") == ranks, out


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_optimizer_with_process_sets_and_compression(ranks):
    out = run_mpi("toolkit_optimizer_check.py", ranks, timeout=180).stdout
    assert out.count("toolkit_optimizer_check rank") == ranks, out
