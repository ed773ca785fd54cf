"""The NCCL backend: collectives on device buffers, enqueued on the coordinator's CUDA stream.

One NCCL communicator per device of this rank (gradsync drives one process set, the world), created
on the first device collective: rank 0 makes the unique id, the coordinator's MPI communicator
broadcasts it, every rank calls ``ncclCommInitRank``. All allreduces of one negotiation cycle are
launched inside one ``ncclGroupStart``/``ncclGroupEnd``. Calls return once the work is enqueued;
the caller orders it with CUDA events. Only the coordinator thread calls it, except
:meth:`NcclBackend.async_error` and :meth:`NcclBackend.close` (``abort=True``), which the device
watchdog may call from its own thread (NCCL allows both concurrently with other calls).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import dtypes, nccl
from ..device import DeviceRuntime
from ..protocol import ReduceOp

#: NCCL dtype names for moving bytes without arithmetic (broadcast, allgather), by item size.
_COPY_DTYPES = {1: "uint8", 2: "float16", 4: "int32", 8: "int64"}


def accumulator(dtype: str, average: bool) -> np.dtype:
    """The dtype a fusion buffer of ``dtype`` tensors has on NCCL.

    float16 and bfloat16 stay native (NCCL reduces them itself); bool travels as 0/1 uint8;
    integer Average sums in int64 (so that the floor of the exact mean can be taken); int16,
    which NCCL lacks, is reduced in int32 (the same result modulo 2**16, as wrapping int16 sums give).
    """
    if dtype == "bool":
        return np.dtype(np.uint8)
    if average and dtype in dtypes.INTEGER:
        return np.dtype(np.int64)
    if dtype == "int16":
        return np.dtype(np.int32)
    return dtypes.NUMPY_DTYPES[dtype]


class NcclBackend:
    """Grouped NCCL collectives on device buffers; see the module docstring.

    Args:
        comm: the coordinator's MPI communicator (the unique id travels over it).
    """

    name = "NCCL"

    def __init__(self, comm) -> None:
        self._mpi = comm
        self._rank, self._size = comm.Get_rank(), comm.Get_size()
        self._comms: dict[int, nccl.Communicator] = {}

    accumulator = staticmethod(accumulator)

    def communicator(self, device: int) -> nccl.Communicator:
        """This rank's communicator on ``device`` (the current CUDA device), created on first use.
        Collective over the coordinator's communicator: every rank calls it at the same point."""
        comm = self._comms.get(device)
        if comm is None:
            uid = nccl.unique_id() if self._rank == 0 else None
            uid = self._mpi.bcast(uid, root=0)
            comm = self._comms[device] = nccl.Communicator.init_rank(self._size, uid, self._rank)
        return comm

    def allreduce(self, runtime: DeviceRuntime, device: int, stream: Any,
                  buffers: list[tuple[Any, np.dtype, ReduceOp, bool]]) -> list[bool]:
        """In-place ncclAllReduce of each (1-d buffer, its dtype, op, logical: 0/1 bool data), all
        in one group.

        Returns, per buffer, whether an Average is already divided by the number of ranks
        (ncclAvg); when False the caller divides."""
        comm = self.communicator(device)
        cuda_stream = runtime.stream_pointer(stream)
        divided = []
        with nccl.group():
            for buffer, dtype, op, logical in buffers:
                pointer = runtime.pointer(buffer)
                name = "bool" if logical else dtypes.dtype_name(dtype)
                comm.allreduce(pointer, pointer, _count(buffer), name, op, cuda_stream)
                # ncclAvg (floating dtypes) divides; an Average run as ncclSum leaves it to the caller.
                divided.append(op == ReduceOp.Average and not nccl.nccl_op(op, name)[1])
        return divided

    def broadcast(self, runtime: DeviceRuntime, device: int, stream: Any, buffer: Any,
                  dtype: np.dtype, root: int) -> None:
        """In-place ncclBroadcast of the 1-d ``buffer`` (of ``dtype``) from ``root``."""
        pointer = runtime.pointer(buffer)
        self.communicator(device).broadcast(pointer, pointer, _count(buffer), _COPY_DTYPES[dtype.itemsize],
                                            root, runtime.stream_pointer(stream))

    def allgather(self, runtime: DeviceRuntime, device: int, stream: Any, send: Any, recv: Any,
                  dtype: np.dtype, counts: list[int]) -> None:
        """Allgatherv: rank r contributes ``counts[r]`` elements; ``recv`` holds them in rank order.
        One ncclBroadcast per rank inside one group (NCCL's allgather needs equal counts)."""
        comm = self.communicator(device)
        cuda_stream = runtime.stream_pointer(stream)
        base, offset = runtime.pointer(recv), 0
        with nccl.group():
            for root, count in enumerate(counts):
                target = base + offset * dtype.itemsize
                source = runtime.pointer(send) if root == self._rank else target
                comm.broadcast(source, target, count, _COPY_DTYPES[dtype.itemsize], root, cuda_stream)
                offset += count

    def async_error(self) -> str | None:
        """NCCL's asynchronous error of any communicator (a failed peer, a network error), else None."""
        for device, comm in list(self._comms.items()):
            error = comm.async_error()
            if error is not None:
                return f"NCCL communicator on device {device}: {error}"
        return None

    def close(self, abort: bool = False) -> None:
        """Destroy every communicator (ncclCommDestroy), or abort them (ncclCommAbort: after an
        error, without waiting for their work)."""
        comms, self._comms = self._comms, {}
        for comm in comms.values():
            comm.abort() if abort else comm.destroy()


def _count(buffer: Any) -> int:
    return math.prod(buffer.shape)
