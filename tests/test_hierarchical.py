"""Hierarchical allreduce (GRADSYNC_HIERARCHICAL_ALLREDUCE=1) equals the flat one, on one host.

On one host only two of its three stages move data (reduce onto local rank 0, broadcast back); the
stage across hosts runs in tests/test_two_hosts.py. The checks are in
tests/workers/hierarchical_check.py.
"""

import re

import pytest

from mpi_launch import run_mpi

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("ranks", [3, pytest.param(4, marks=pytest.mark.full)])
def test_hierarchical_allreduce_equals_the_flat_one_on_one_host(ranks):
    out = run_mpi("hierarchical_check.py", ranks, timeout=120,
                  env={"GRADSYNC_HIERARCHICAL_ALLREDUCE": "1"}).stdout
    passed = re.findall(r"hierarchical_check rank (\d+): \d+ cases passed", out)
    assert sorted(passed) == [str(r) for r in range(ranks)], out
