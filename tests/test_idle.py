"""An idle coordinator blocks: it runs no negotiation cycle until work arrives (no polling)."""

import time

import numpy as np

import gradsync


def test_idle_coordinator_runs_no_cycles():
    gradsync.init()
    try:
        gradsync.allreduce(np.ones(3), name="warm")
        negotiator = gradsync.runtime.get().coordinator.negotiator
        before = negotiator.full_cycles + negotiator.cached_cycles
        time.sleep(0.3)  # 300 cycle times of 1 ms: a polling coordinator would have cycled
        assert negotiator.full_cycles + negotiator.cached_cycles == before
        gradsync.allreduce(np.ones(3), name="warm")
        assert negotiator.full_cycles + negotiator.cached_cycles == before + 1
    finally:
        gradsync.shutdown()


def test_a_name_is_free_again_as_soon_as_synchronize_returns(monkeypatch):
    """The coordinator releases a collective's name before it completes the handle, so a caller
    that reuses the name right after synchronize() never finds it still in flight."""
    gradsync.init()
    try:
        queue = gradsync.runtime.get().coordinator.queue
        order = []
        release, complete = queue.finished, gradsync.Handle._set_result

        def finished(names):
            order.extend(("release", n) for n in names)
            release(names)

        def set_result(handle, *args):
            order.append(("result", handle.name))
            complete(handle, *args)

        monkeypatch.setattr(queue, "finished", finished)
        monkeypatch.setattr(gradsync.Handle, "_set_result", set_result)
        for _ in range(5):
            gradsync.allreduce_(np.ones(4), name="again", op=gradsync.Sum)
        assert order == [("release", "again"), ("result", "again")] * 5
    finally:
        gradsync.shutdown()
