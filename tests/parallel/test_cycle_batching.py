"""Cycle batching: asynchronous requests that arrive within the cycle time of the last cycle
(gradients during backward) share the next cycle, and a thread that waits for a collective (a
blocking op, synchronize()) is never held back by the cycle time. Run with caller runs off, so
that the background thread runs every cycle (the batching is its own)."""

import threading
import time

import numpy as np
import pytest

import gradsync

CYCLE_TIME_MS = 2000.0  # long enough that batching and a delayed wait cannot be mistaken


@pytest.fixture
def slow_cycles(monkeypatch):
    """The session's coordinator with a 2 s cycle time, caller runs off, and the number of this
    rank's new requests in each of its cycles (in order)."""
    coordinator = gradsync.process.runtime.get().coordinator
    monkeypatch.setattr(coordinator, "caller_runs", False)
    gradsync.barrier()  # every rank's cycles before the change have ended
    monkeypatch.setattr(coordinator.negotiator, "cycle_time", CYCLE_TIME_MS)
    new_per_cycle: list[int] = []
    cycle = coordinator.negotiator.cycle

    def recorded(requests, *args, **kwargs):
        if requests:
            new_per_cycle.append(len(requests))
        return cycle(requests, *args, **kwargs)

    monkeypatch.setattr(coordinator.negotiator, "cycle", recorded)
    yield new_per_cycle
    monkeypatch.undo()
    gradsync.barrier()


def mine(n: int, i: int = 0) -> np.ndarray:
    return np.arange(n, dtype=np.float64) + 100.0 * gradsync.rank() + i


def total(n: int, i: int = 0) -> np.ndarray:
    return sum(np.arange(n, dtype=np.float64) + 100.0 * r + i for r in range(gradsync.size()))


def test_async_requests_submitted_together_share_one_cycle(slow_cycles):
    gradsync.allreduce(mine(4), name="batch.before", op=gradsync.Sum)  # a cycle has just ended
    slow_cycles.clear()
    handles = []
    for i in range(10):  # 10 ms apart: time for the background thread to take each one alone
        handles.append(gradsync.allreduce_async(mine(16, i), name=f"batch.{i}", op=gradsync.Sum))
        time.sleep(0.01)
    for i, handle in enumerate(handles):
        np.testing.assert_array_equal(gradsync.synchronize(handle), total(16, i))
    assert slow_cycles[0] == 10, slow_cycles


def test_a_blocking_op_right_after_a_cycle_runs_at_once(slow_cycles):
    start = time.monotonic()
    for i in range(5):  # each one just after the last one's cycle, inside its cycle time
        np.testing.assert_array_equal(gradsync.allreduce(mine(8, i), name=f"batch.blocking.{i}",
                                                         op=gradsync.Sum), total(8, i))
    assert time.monotonic() - start < CYCLE_TIME_MS / 1000.0, "a blocking op waited for the cycle time"


def test_synchronize_of_a_batched_request_cycles_at_once(slow_cycles):
    gradsync.allreduce(mine(4), name="batch.sync.before", op=gradsync.Sum)
    handle = gradsync.allreduce_async(mine(32), name="batch.sync", op=gradsync.Sum)
    start = time.monotonic()
    np.testing.assert_array_equal(gradsync.synchronize(handle), total(32))
    assert time.monotonic() - start < CYCLE_TIME_MS / 1000.0, "synchronize() waited for the cycle time"


def test_a_wait_from_another_thread_ends_the_batching(slow_cycles):
    gradsync.allreduce(mine(4), name="batch.thread.before", op=gradsync.Sum)
    handle = gradsync.allreduce_async(mine(8), name="batch.thread", op=gradsync.Sum)
    result: list[np.ndarray] = []
    waiter = threading.Thread(target=lambda: result.append(gradsync.synchronize(handle)))
    start = time.monotonic()
    waiter.start()
    waiter.join(60)
    assert result and time.monotonic() - start < CYCLE_TIME_MS / 1000.0
    np.testing.assert_array_equal(result[0], total(8))


def test_a_waited_request_still_pending_on_other_ranks_is_negotiated_again_at_once(slow_cycles):
    """The end of backward: rank 0 negotiates the layout exchange in the bucket's cycle, in which
    the other ranks had only the bucket; rank 0's thread waits for it. Its next cycle, which the
    others' cycle with it needs, comes at once, not after the cycle time."""
    if gradsync.size() < 2:
        pytest.skip("needs a request that some ranks have not submitted yet")
    gradsync.allreduce(mine(4), name="batch.pending.before", op=gradsync.Sum)
    first = gradsync.allreduce_async(mine(8), name="batch.pending.first", op=gradsync.Sum)
    if gradsync.rank() == 0:
        late = gradsync.allreduce_async(mine(8, 1), name="batch.pending.late", op=gradsync.Sum)
        start = time.monotonic()
        np.testing.assert_array_equal(gradsync.synchronize(late), total(8, 1))
        waited = time.monotonic() - start
        np.testing.assert_array_equal(gradsync.synchronize(first), total(8))
    else:
        np.testing.assert_array_equal(gradsync.synchronize(first), total(8))  # its cycle: first only
        time.sleep(0.2)
        late = gradsync.allreduce_async(mine(8, 1), name="batch.pending.late", op=gradsync.Sum)
        np.testing.assert_array_equal(gradsync.synchronize(late), total(8, 1))
        waited = 0.0
    assert waited < CYCLE_TIME_MS / 1000.0, f"rank 0 waited {waited:.2f} s: the cycle time"
