"""gradsync beside the user's own code: see tests/workers/beside_user_code.py."""

import pytest

from mpi_launch import run_mpi

# A short stall shutdown turns a naming mismatch into a failure instead of a hang.
ENV = {"GRADSYNC_STALL_CHECK_TIME_SECONDS": "2", "GRADSYNC_STALL_SHUTDOWN_TIME_SECONDS": "5"}


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_beside_user_code(ranks):
    out = run_mpi("beside_user_code.py", ranks, timeout=120, env=ENV).stdout
    assert out.count("beside_user_code rank") == ranks, out
    assert out.count("torch not imported") == ranks, out


@pytest.mark.mpi
@pytest.mark.torch
def test_a_torch_tensor_rejected_on_one_rank_does_not_shift_names():
    out = run_mpi("beside_user_code.py", 2, "--torch", timeout=120, env=ENV).stdout
    assert out.count("beside_user_code rank") == 2, out
    assert "ok torch_check_rejected_unnamed_torch_call_does_not_shift_names" in out, out
