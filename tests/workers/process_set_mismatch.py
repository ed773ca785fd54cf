"""Ranks submit the same name on different process sets (3 ranks): rank 0 on the set [0, 1], ranks
1 and 2 on the global set. Both handles must fail, on every rank that waits, with a stall report
that says which process set each rank used (run with a short stall shutdown time)."""

import sys
import time

import numpy as np
from mpi4py import MPI

import gradsync

gradsync.init()
rank = gradsync.rank()
pair = gradsync.add_process_set([0, 1])
started = time.monotonic()
handles = []
if rank == 0:
    handles.append(gradsync.allreduce_async(np.ones(2), name="x", process_set=pair))
else:
    handles.append(gradsync.allreduce_async(np.ones(2), name="x"))
for handle in handles:
    try:
        gradsync.synchronize(handle)
    except gradsync.StallError as exc:
        text = str(exc)
        assert "ranks disagree on process set" in text, text
        assert "rank 0: process set 1" in text and "rank 1: process set 0" in text, text
        report = next(line for line in text.splitlines() if "disagree" in line)
        # one write per line: lines of different ranks do not run into each other
        sys.stdout.write(f"rank {rank}: StallError after {time.monotonic() - started:.1f} s: "
                         f"{text.splitlines()[0]}\nrank {rank}: report: {report}\n")
        sys.stdout.flush()
    else:
        raise AssertionError("a process-set mismatch completed")
# Each set reaches its own stall verdict; a rank that exits first would run gradsync.shutdown(),
# which fails the *other* set's still-pending 'x' with ShutdownError instead. Exit together, on the
# user's COMM_WORLD (gradsync uses its own duplicates).
MPI.COMM_WORLD.Barrier()
