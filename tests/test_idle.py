"""An idle coordinator blocks: it runs no negotiation cycle until work arrives (no polling)."""

import sys
import time

import numpy as np

import gradsync


def test_idle_coordinator_runs_no_cycles():
    gradsync.init()
    try:
        gradsync.allreduce(np.ones(3), name="warm")
        negotiator = gradsync.process.runtime.get().coordinator.negotiator
        before = negotiator.full_cycles + negotiator.cached_cycles
        time.sleep(0.3)  # 300 cycle times of 1 ms: a polling coordinator would have cycled
        assert negotiator.full_cycles + negotiator.cached_cycles == before
        gradsync.allreduce(np.ones(3), name="warm")
        assert negotiator.full_cycles + negotiator.cached_cycles == before + 1
    finally:
        gradsync.shutdown()


def test_a_name_is_free_again_as_soon_as_its_handle_completes():
    """A caller that reuses a name as soon as the collective of that name completes never finds it
    still in flight: the coordinator releases the name before it completes the handle. Checked
    where the order matters: the coordinator's own thread completes every handle (no caller runs
    a cycle) while this thread waits in synchronize(), and this thread, woken with the GIL handed
    over as early as the interpreter can, reuses the name at once. (With the handle completed
    before the name was released, 5 runs of 5 of this test failed.)"""
    gradsync.init(caller_runs=False)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for i in range(2000):
            handle = gradsync.allreduce_async(np.full(4, float(i)), name="again", op=gradsync.Sum)
            np.testing.assert_array_equal(gradsync.synchronize(handle), np.full(4, float(i)))
    finally:
        sys.setswitchinterval(interval)
        gradsync.shutdown()
