"""The multi-rank harness itself: every rank runs each test, in step with the others."""

import numpy as np

import gradsync


def test_every_rank_runs_this_test_with_the_whole_world():
    ranks = gradsync.allgather(np.array([gradsync.rank()]))
    assert ranks.tolist() == list(range(gradsync.size()))


def test_gradsync_is_initialised_once_for_the_session():
    assert gradsync.is_initialized()
