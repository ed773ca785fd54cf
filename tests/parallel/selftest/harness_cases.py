"""Cases for tests/test_parallel.py's checks of the harness itself (not a test file of its own: its
name does not match test_*.py, so only an explicit path runs it)."""

import os

import numpy as np

import gradsync


def test_passes_everywhere():
    assert gradsync.allreduce(np.full(1, float(gradsync.rank())),
                              op=gradsync.Sum)[0] == sum(range(gradsync.size()))


def test_fails_on_the_last_rank_only():
    assert gradsync.rank() != gradsync.size() - 1, "this rank was told to fail"


def test_after_a_failure_the_ranks_are_still_in_step():
    # Both collectives pair up with the other ranks' (were a rank a test ahead, they would not).
    pids = gradsync.allgather_object(os.getpid())
    assert pids[gradsync.rank()] == os.getpid() and len(set(pids)) == gradsync.size()
    assert gradsync.broadcast_object(os.getpid(), root_rank=0) == pids[0]
