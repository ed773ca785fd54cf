"""stall_check.py for the torch.distributed backend: a ``dist.all_reduce`` that the last rank
never issues. Rank 0 warns, naming the missing rank; with a shutdown time every other rank's
``work.wait()`` raises the StallError instead of hanging, and the last rank's next call fails.

The stall times come from the environment (the test sets GRADSYNC_STALL_CHECK_TIME_SECONDS=1 and
GRADSYNC_STALL_SHUTDOWN_TIME_SECONDS=3); the last rank idles IDLE_SECONDS in user code.
"""

import os
import time

import torch
import torch.distributed as dist

import gradsync
import gradsync.torch  # noqa: F401 - registers the backend

torch.set_num_threads(1)
dist.init_process_group(backend="gradsync", init_method="gradsync://")
rank, size = dist.get_rank(), dist.get_world_size()
dist.all_reduce(torch.ones(2))  # every rank is up
start = time.monotonic()
if rank != size - 1:
    work = dist.all_reduce(torch.ones(3), async_op=True)  # the last rank never issues it
    try:
        work.wait()
    except gradsync.StallError as exc:
        print(f"rank {rank}: StallError after {time.monotonic() - start:.1f} s: {exc}", flush=True)
    else:
        raise AssertionError("an all_reduce that one rank never issued completed")
else:
    time.sleep(float(os.environ["IDLE_SECONDS"]))
    try:
        dist.all_reduce(torch.ones(2))
    except gradsync.GradsyncError as exc:  # gradsync has shut down everywhere by now
        print(f"rank {rank}: after the stall: {type(exc).__name__}: {exc}", flush=True)
