"""gradsync living beside user code: unnamed-op names stay aligned after a call rejected on one rank
only; the user's own mpi4py traffic on COMM_WORLD runs while gradsync reduces in the background; a
process forked after init() gets a clear error and the parent goes on and shuts down cleanly.
With --torch, only the torch half: a torch tensor rejected on one rank only.
"""

import os

import numpy as np
from harness import run_numpy_or_torch_checks, torch_requested
from mpi4py import MPI

import gradsync

if torch_requested():  # before the checks: importing torch on a loaded machine can outlast the stall timeout
    import torch

gradsync.init()
rank, size = gradsync.rank(), gradsync.size()
world = MPI.COMM_WORLD


def check_rejected_unnamed_call_does_not_shift_names():
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
    unnamed_ops_pair_up()


def torch_check_rejected_unnamed_torch_call_does_not_shift_names():
    if rank == 0:
        try:
            gradsync.allreduce(torch.eye(3).to_sparse())
        except TypeError as exc:
            assert "sparse_coo" in str(exc) and "sparse_as_dense=True" in str(exc), exc
        else:
            raise AssertionError("a sparse tensor was accepted")
    unnamed_ops_pair_up()


def unnamed_ops_pair_up():
    # Every rank's next unnamed ops must pair up: otherwise this waits until the stall shutdown.
    for i in range(3):
        out = gradsync.allreduce(np.full(2, float(rank + i)), op=gradsync.Sum)
        assert np.all(out == sum(r + i for r in range(size))), out
    assert gradsync.broadcast_object({"from": rank}, root_rank=0) == {"from": 0}


def check_user_mpi_traffic_beside_gradsync():
    handles = [gradsync.allreduce_async(np.full(1000, float(rank)), name=f"bg.{i}", op=gradsync.Sum)
               for i in range(50)]
    mine = np.full(1000, float(rank + 1))
    for _ in range(20):  # the user's own collectives on COMM_WORLD, from the main thread
        buf = mine.copy()
        world.Allreduce(MPI.IN_PLACE, buf)
        assert np.all(buf == sum(r + 1 for r in range(size)))
        assert world.bcast(rank, root=0) == 0
    for handle in handles:
        assert np.all(gradsync.synchronize(handle) == sum(range(size)))


def check_forked_child_gets_a_clear_error():
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
    assert os.waitstatus_to_exitcode(status) == 0, status
    out = gradsync.allreduce(np.ones(2), name="after.fork", op=gradsync.Sum)
    assert np.all(out == size)


run_numpy_or_torch_checks(globals())
print(f"beside_user_code rank {rank}: passed", flush=True)
