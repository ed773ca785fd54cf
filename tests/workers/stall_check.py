"""A collective that only some ranks submit: rank 0 warns with both rank lists, then (with a shutdown
time) every rank's pending handle fails with the report instead of hanging.

Rank size-1 never submits 'only.some' and sits idle in user code, so its coordinator reaches the
cycles only through the idle heartbeat. The stall times come from the environment (the test sets
GRADSYNC_STALL_CHECK_TIME_SECONDS=1 and GRADSYNC_STALL_SHUTDOWN_TIME_SECONDS=3).
"""

import os
import time

import numpy as np

import gradsync

gradsync.init()
rank, size = gradsync.rank(), gradsync.size()
gradsync.allreduce(np.ones(2), name="cached.first")  # so that the cached path is exercised too
start = time.monotonic()
if rank != size - 1:
    handles = [gradsync.allreduce_async(np.ones(2), name="cached.first"),
               gradsync.allreduce_async(np.ones(3), name="only.some")]
    try:
        for handle in handles:
            gradsync.synchronize(handle)
    except gradsync.StallError as exc:
        print(f"rank {rank}: StallError after {time.monotonic() - start:.1f} s: {exc}", flush=True)
    else:
        raise AssertionError("a collective that one rank never submitted completed")
else:
    time.sleep(float(os.environ["IDLE_SECONDS"]))  # the rank that never submits
    try:
        gradsync.allreduce(np.ones(2), name="late")
    except gradsync.GradsyncError as exc:  # gradsync has shut down everywhere by now
        print(f"rank {rank}: after the stall: {type(exc).__name__}: {exc}", flush=True)
