"""Ranks that resolve GRADSYNC_GPU_OPERATIONS differently get the same error, listing each rank's choice.

Rank 0 asks for MPI, the others for NCCL (as a rank without the NCCL library and one with it would
by default); the first device collective fails on every rank instead of hanging.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for fakegpu

from harness import run_checks  # noqa: E402

import fakegpu  # noqa: E402
import gradsync as gs  # noqa: E402
from gradsync import CollectiveError  # noqa: E402

gs.init(gpu_operations="MPI" if MPI.COMM_WORLD.Get_rank() == 0 else "NCCL")


def check_the_first_device_collective_fails_on_every_rank():
    try:
        gs.allreduce(fakegpu.array(np.ones(3, np.float32)), name="first")
    except CollectiveError as exc:
        message = str(exc)
    else:
        raise AssertionError("ranks with different GPU backends went ahead")
    listed = ", ".join(f"rank {r}: {'MPI' if r == 0 else 'NCCL'}" for r in range(gs.size()))
    assert f"the ranks move GPU tensors differently ({listed})" in message, message
    assert "GRADSYNC_GPU_OPERATIONS" in message
    # Host collectives still work afterwards.
    np.testing.assert_array_equal(gs.allreduce(np.ones(2), name="host", op=gs.Sum), np.full(2, gs.size()))


if __name__ == "__main__":
    print(f"device_mismatch rank {gs.rank()}: {run_checks(globals())} checks passed", flush=True)
