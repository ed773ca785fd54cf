"""The MPI backend: collectives on host (numpy) buffers over the coordinator's own communicator.

Only the coordinator thread calls it. Every call is a blocking MPI collective; mpi4py releases the
GIL while it waits, so the training thread keeps running (PERF-NOTES.md, facts 1 and 2).
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ..protocol import ReduceOp

_MPI_OPS = {
    ReduceOp.Average: MPI.SUM,
    ReduceOp.Sum: MPI.SUM,
    ReduceOp.Min: MPI.MIN,
    ReduceOp.Max: MPI.MAX,
    ReduceOp.Product: MPI.PROD,
}
# bool tensors travel as 0/1 uint8: Sum and Max are logical OR, Min and Product logical AND.
_BOOL_OPS = {
    ReduceOp.Sum: MPI.MAX,
    ReduceOp.Max: MPI.MAX,
    ReduceOp.Min: MPI.MIN,
    ReduceOp.Product: MPI.MIN,
}


class MpiBackend:
    """Blocking collectives on contiguous numpy buffers, same semantics as the MPI calls they wrap."""

    def __init__(self, comm: MPI.Comm) -> None:
        self.comm = comm

    def allreduce(self, buffer: np.ndarray, op: ReduceOp, logical: bool = False) -> None:
        """In-place MPI_Allreduce of the contiguous ``buffer``; ``logical`` for 0/1 bool data."""
        mpi_op = _BOOL_OPS[op] if logical else _MPI_OPS[op]
        self.comm.Allreduce(MPI.IN_PLACE, buffer, op=mpi_op)

    def broadcast(self, buffer: np.ndarray, root: int) -> None:
        """In-place MPI_Bcast of the contiguous ``buffer``'s bytes from ``root``."""
        self.comm.Bcast(buffer.reshape(-1).view(np.uint8), root=root)

    def allgather(self, send: np.ndarray, recv: np.ndarray, counts: list[int]) -> None:
        """MPI_Allgatherv of bytes: rank r contributes ``counts[r]`` bytes; ``recv`` holds them all."""
        displacements = np.concatenate(([0], np.cumsum(counts)[:-1])).tolist()
        self.comm.Allgatherv(send.reshape(-1).view(np.uint8),
                             [recv.reshape(-1).view(np.uint8), (counts, displacements), MPI.BYTE])
