"""gradsync living beside the user's own code: unnamed ops stay paired across ranks after a call
rejected on one rank only; the user's own mpi4py collectives on COMM_WORLD run while gradsync
reduces in the background; a process forked after init() gets a clear error and the parent goes
on; and none of it imports a framework. (A torch tensor rejected on one rank: test_ops_torch.py.)
"""

from __future__ import annotations

import os

import numpy as np
from mpi4py import MPI
from reference import assert_no_framework_was_imported, assert_unnamed_ops_pair_up

import gradsync


def test_an_unnamed_call_rejected_on_one_rank_takes_no_name(rank, size):
    if rank == 0:
        try:
            gradsync.allreduce(np.ones(2, np.complex64))  # rejected here, before naming
        except TypeError as exc:
            assert "(unnamed)" in str(exc) and "complex64" in str(exc), exc
        else:
            raise AssertionError("complex64 was accepted")
        try:
            gradsync.broadcast(np.ones(2), root_rank=size)
        except ValueError as exc:
            assert "root_rank" in str(exc), exc
        else:
            raise AssertionError(f"root_rank={size} was accepted in a world of {size}")
    assert_unnamed_ops_pair_up(rank, size)


def test_the_users_own_collectives_on_comm_world_run_beside_background_reductions(rank, size):
    world = MPI.COMM_WORLD
    handles = [gradsync.allreduce_async(np.full(1000, float(rank)), name=f"bg.{i}", op=gradsync.Sum)
               for i in range(50)]
    mine = np.full(1000, float(rank + 1))
    for _ in range(20):  # the user's own collectives on COMM_WORLD, from the main thread
        buf = mine.copy()
        world.Allreduce(MPI.IN_PLACE, buf)
        np.testing.assert_array_equal(buf, np.full(1000, float(sum(r + 1 for r in range(size)))))
        assert world.bcast(rank, root=0) == 0
    for handle in handles:
        np.testing.assert_array_equal(gradsync.synchronize(handle), np.full(1000, float(sum(range(size)))))


def test_a_process_forked_after_init_gets_a_clear_error_and_the_parent_goes_on(size):
    pid = os.fork()
    if pid == 0:  # the child: must not touch the coordinator or MPI
        code = 1
        try:
            gradsync.allreduce(np.ones(2), name="from.child")
        except gradsync.GradsyncError as exc:
            code = 0 if "forked from rank" in str(exc) and "DataLoader" in str(exc) else 2
        except BaseException:
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child's exit status: 1 no error, 2 another message, 3 another exception"
    out = gradsync.allreduce(np.ones(2), name="after.fork", op=gradsync.Sum)
    np.testing.assert_array_equal(out, np.full(2, float(size)))


def test_none_of_this_imported_torch_or_jax(request):
    assert_no_framework_was_imported(request.session)
