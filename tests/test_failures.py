"""No hang when a rank fails: the survivors get an error naming the rank, the job exits non-zero."""

import pytest

from mpi_launch import run_mpi

pytestmark = [pytest.mark.mpi, pytest.mark.torch]


def test_exception_on_one_rank_releases_the_others():
    result = run_mpi("rank_raises.py", 2, timeout=90, check=False)
    assert result.returncode != 0
    assert "user code failed on rank 1" in result.stdout
    assert "rank 0: step 1 failed" in result.stdout, result.stdout
    assert "did not complete: rank(s) [1] called gradsync.shutdown() (or exited) first" in \
        result.stdout, result.stdout
