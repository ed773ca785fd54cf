"""A coordinator's life on one rank: built without threads, started by start(), stopped by
shutdown() whether it was started or not (a world of one process: the negotiation is with itself)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from gradsync.config import Config
from gradsync.engine.coordinator import Coordinator
from gradsync.engine.protocol import Kind, ReduceOp, Request
from gradsync.engine.request_queue import Entry
from gradsync.errors import ShutdownError
from gradsync.handles import Handle
from gradsync.process.launch import start_mpi

THREAD = "gradsync-coordinator"


@pytest.fixture
def comm():
    comm = start_mpi().COMM_SELF.Dup()  # MPI as gradsync.init() starts it, if no test did yet
    yield comm
    comm.Free()


def coordinator_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD]


def allreduce(name: str, data: np.ndarray, prescale: float) -> Entry:
    """An allreduce (Average) of ``data`` into a new array, scaled by ``prescale`` first."""
    out = np.zeros_like(data)
    request = Request(name, Kind.ALLREDUCE, 0, str(data.dtype), data.shape, op=ReduceOp.Average,
                      prescale=prescale)
    return Entry(request, Handle(name), data, out, out)


def test_building_starts_no_thread_and_shutdown_without_start_fails_what_was_submitted(comm):
    before = coordinator_threads()
    coordinator = Coordinator(comm, Config.resolve(environ={}))
    assert coordinator_threads() == before
    handle = coordinator.submit(allreduce("x", np.arange(4, dtype=np.float32), 1.0))
    assert coordinator.shutdown(5.0)
    with pytest.raises(ShutdownError, match="'x' did not complete: gradsync.shutdown.. was called before"):
        handle.wait(1.0)
    assert coordinator.queue.closed and coordinator_threads() == before


def test_start_runs_the_cycles_on_its_thread_until_shutdown(comm):
    before = coordinator_threads()
    coordinator = Coordinator(comm, Config.resolve({"caller_runs": False}, environ={}))
    coordinator.start()
    started = [t for t in coordinator_threads() if t not in before]
    assert len(started) == 1
    data = np.arange(6, dtype=np.float64).reshape(2, 3)
    handle = coordinator.submit(allreduce("y", data, 3.0))
    np.testing.assert_array_equal(handle.wait(10.0), data * 3.0)  # one rank: the mean is itself
    assert handle.divisor == 1
    assert coordinator.shutdown(10.0)
    assert not started[0].is_alive()
