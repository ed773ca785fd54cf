"""The process lifecycle: nothing works before init(), everything after, nothing after shutdown().

Runs in the pytest process itself: init() there starts MPI as a singleton (a world of one rank),
and every test that initialises shuts down again.
"""

from __future__ import annotations

import numpy as np
import pytest

import gradsync as gs
from gradsync import metrics
from mpi_launch import run_mpi


@pytest.fixture
def not_initialized():
    assert not gs.is_initialized()
    yield
    gs.shutdown()


@pytest.fixture
def initialized(not_initialized):
    gs.init()
    yield


CALLS_NEEDING_INIT = {
    "rank": lambda: gs.rank(),
    "size": lambda: gs.size(),
    "local_rank": lambda: gs.local_rank(),
    "local_size": lambda: gs.local_size(),
    "cross_rank": lambda: gs.cross_rank(),
    "cross_size": lambda: gs.cross_size(),
    "allreduce": lambda: gs.allreduce(np.ones(3)),
    "allreduce_": lambda: gs.allreduce_(np.ones(3), name="x"),
    "allreduce_async": lambda: gs.allreduce_async(np.ones(3), name="x"),
    "broadcast": lambda: gs.broadcast(np.ones(3), 0),
    "broadcast_async_": lambda: gs.broadcast_async_(np.ones(3), 0, name="x"),
    "allgather": lambda: gs.allgather(np.ones(3)),
    "barrier": lambda: gs.barrier(),
    "broadcast_object": lambda: gs.broadcast_object({"a": 1}),
    "allgather_object": lambda: gs.allgather_object([1]),
    "metrics.allreduce_scalar": lambda: metrics.allreduce_scalar(1.0),
    "metrics.average_scalars": lambda: metrics.average_scalars({"a": 1.0}),
    "Metric.update": lambda: metrics.Metric("x").update(1.0),
    "Metric.compute": lambda: metrics.Metric("x").compute(),
}


@pytest.mark.parametrize("call", CALLS_NEEDING_INIT.values(), ids=CALLS_NEEDING_INIT.keys())
def test_before_init_every_call_raises_not_initialized(not_initialized, call):
    with pytest.raises(gs.NotInitializedError, match=r"call gradsync\.init\(\) first"):
        call()


def test_not_initialized_is_a_gradsync_error_and_a_runtime_error():
    assert issubclass(gs.NotInitializedError, gs.GradsyncError)
    assert issubclass(gs.GradsyncError, RuntimeError)
    assert issubclass(gs.CollectiveError, gs.GradsyncError)
    assert issubclass(gs.ShutdownError, gs.GradsyncError)


def test_a_bad_setting_fails_init_and_leaves_it_uninitialized(not_initialized, monkeypatch):
    with pytest.raises(TypeError, match="fusion_treshold"):
        gs.init(fusion_treshold=1)
    monkeypatch.setenv("GRADSYNC_CYCLE_TIME", "soon")
    with pytest.raises(ValueError, match="GRADSYNC_CYCLE_TIME"):
        gs.init()
    assert not gs.is_initialized()
    with pytest.raises(gs.NotInitializedError):
        gs.rank()


def test_alone_the_process_is_rank_0_of_1(initialized):
    assert gs.is_initialized()
    assert (gs.rank(), gs.size()) == (0, 1)
    assert (gs.local_rank(), gs.local_size()) == (0, 1)
    assert (gs.cross_rank(), gs.cross_size()) == (0, 1)
    x = np.arange(4.0)
    np.testing.assert_array_equal(gs.allreduce(x), x)
    np.testing.assert_array_equal(gs.allgather(x), x)
    assert gs.broadcast_object("hello") == "hello"
    gs.barrier()


def test_a_second_init_is_a_no_op(initialized):
    gs.allreduce(np.ones(2))  # auto-named 'allreduce.noname.0'
    gs.init(fusion_threshold=0)
    assert gs.is_initialized() and gs.size() == 1
    gs.allreduce(np.ones(2))  # the same runtime continues: 'allreduce.noname.1'


def test_after_shutdown_calls_raise_not_initialized_again(initialized):
    gs.shutdown()
    assert not gs.is_initialized()
    with pytest.raises(gs.NotInitializedError, match=r"call gradsync\.init\(\) first"):
        gs.allreduce(np.ones(3))
    gs.shutdown()  # a second shutdown is harmless


def test_init_works_again_after_shutdown(not_initialized):
    for _ in range(2):
        gs.init()
        np.testing.assert_array_equal(gs.allreduce(np.ones(3), op=gs.Sum), np.ones(3))
        gs.shutdown()
        assert not gs.is_initialized()


@pytest.mark.mpi
def test_a_backend_failure_names_the_tensor_and_stops_gradsync():
    out = run_mpi("backend_error.py", 1, timeout=60, check=False).stdout
    assert "backend_error: passed" in out, out
