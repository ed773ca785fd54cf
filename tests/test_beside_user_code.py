"""gradsync beside the user's own code: see tests/workers/beside_user_code.py."""

import pytest

from mpi_launch import run_mpi


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_beside_user_code(ranks):
    # A short stall shutdown turns a naming mismatch into a failure instead of a hang.
    out = run_mpi("beside_user_code.py", ranks, timeout=120,
                  env={"GRADSYNC_STALL_CHECK_TIME_SECONDS": "2",
                       "GRADSYNC_STALL_SHUTDOWN_TIME_SECONDS": "5"}).stdout
    assert out.count("beside_user_code rank") == ranks, out
