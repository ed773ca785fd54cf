"""TensorQueue's waits: what ends the coordinator's wait, with and without batching (one process,
no MPI: a second thread stands in for the submitting user)."""

import threading
import time

import numpy as np

from gradsync.engine.protocol import Kind, Request
from gradsync.engine.request_queue import WAITING, Entry, TensorQueue
from gradsync.handles import Handle

LONG = 5.0  # seconds: a wait that is not ended early runs to this timeout


def entry(name: str) -> Entry:
    data = np.zeros(4, np.float32)
    return Entry(Request(name, Kind.ALLREDUCE, 0, "float32", (4,)), Handle(name), data, data, data)


def waited(queue: TensorQueue, act, timeout: float = LONG, batching: bool = False) -> float:
    """Seconds that ``queue.wait(timeout, batching=batching)`` took while another thread runs
    ``act`` 50 ms after the wait began."""
    def later():
        time.sleep(0.05)
        act()

    other = threading.Thread(target=later)
    start = time.monotonic()
    other.start()
    queue.wait(timeout, batching=batching)
    elapsed = time.monotonic() - start
    other.join()
    return elapsed


def test_a_push_ends_a_plain_wait():
    queue = TensorQueue(0)
    assert waited(queue, lambda: queue.push(entry("a"))) < LONG / 2


def test_a_push_does_not_end_a_batching_wait():
    queue = TensorQueue(0)
    assert waited(queue, lambda: queue.push(entry("a")), timeout=0.5, batching=True) >= 0.45
    assert queue.take()[0][0].request.name == "a"


def test_hurry_ends_a_batching_wait_for_new_entries():
    queue = TensorQueue(0)
    queue.push(entry("a"))
    assert waited(queue, queue.hurry, batching=True) < LONG / 2


def test_a_push_from_a_blocking_op_ends_a_batching_wait():
    queue = TensorQueue(0)

    def blocking_push():
        token = WAITING.set(True)
        try:
            queue.push(entry("a"))
        finally:
            WAITING.reset(token)

    assert waited(queue, blocking_push, batching=True) < LONG / 2
    assert queue.pressing()
    queue.take()
    assert not queue.pressing(), "take() starts a new batch"


def test_hurry_without_new_entries_ends_no_wait():
    # A thread waiting for a request already taken (pending on other ranks) must not make the
    # coordinator's waits return at once, which would spin it.
    queue = TensorQueue(0)
    queue.hurry()
    start = time.monotonic()
    queue.wait(0.3)
    assert time.monotonic() - start >= 0.25
    queue.wait(0.3, batching=True)
    assert time.monotonic() - start >= 0.55


def test_shutdown_ends_a_batching_wait():
    queue = TensorQueue(0)
    queue.push(entry("a"))
    assert waited(queue, queue.request_shutdown, batching=True) < LONG / 2
