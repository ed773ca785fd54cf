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
