"""A backend error that is not a CollectiveError (an MPI or NCCL failure) fails the collective's
handle with a CollectiveError naming the tensor and the cause, then stops gradsync on this rank."""

import numpy as np

import gradsync

gradsync.init()
coordinator = gradsync.process.runtime.get().coordinator


def failing_allreduce(buffer, op, logical=False, scale=1.0, source=None):
    raise RuntimeError("backend exploded")


coordinator.host.backend.allreduce = failing_allreduce
try:
    gradsync.allreduce(np.ones(4), name="doomed")
except gradsync.CollectiveError as exc:
    text = str(exc)
    assert "allreduce of 'doomed' failed: RuntimeError: backend exploded" in text, text
else:
    raise AssertionError("the backend's error was swallowed")
try:
    gradsync.allreduce(np.ones(4), name="after")
except gradsync.GradsyncError as exc:
    assert "the background coordinator failed" in str(exc), exc
else:
    raise AssertionError("gradsync kept running after a backend failure")
print("backend_error: passed", flush=True)
