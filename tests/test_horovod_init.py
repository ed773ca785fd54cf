"""gradsync.torch.init takes Horovod's ``comm=[ranks]`` and ``process_sets="dynamic"``
(tests/workers/horovod_init_check.py)."""

import pytest

from mpi_launch import run_mpi


@pytest.mark.mpi
@pytest.mark.torch
def test_init_with_a_list_of_ranks_numbers_them_in_its_order():
    out = run_mpi("horovod_init_check.py", 3, timeout=120).stdout
    # ranks [1, 0]: world 1 is rank 0, world 0 is rank 1; world 2 is not in the list
    assert "hvd rank 0 of 2 (world 1)" in out and "hvd rank 1 of 2 (world 0)" in out, out
    assert "world 2: ValueError: gradsync: rank 2: init(comm=[1, 0]): this rank is not in the list" in out, out
