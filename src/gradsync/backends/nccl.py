"""The NCCL backend: collectives on device buffers, enqueued on the coordinator's CUDA stream.

One NCCL communicator per device of this rank, created on the first device collective: rank 0
makes the unique id, the coordinator's MPI communicator broadcasts it, every rank calls
``ncclCommInitRank``. All allreduces of one negotiation cycle are launched inside one
``ncclGroupStart``/``ncclGroupEnd``. Calls return once the work is enqueued; the caller orders it
with CUDA events.

NCCL lets one thread at a time operate a communicator (its "Thread Safety" page): every call here
holds the backend's lock, taken only across NCCL calls, so that the device watchdog can abort the
communicators (:meth:`NcclBackend.close` with ``abort=True``) while the coordinator thread is
blocked elsewhere (in MPI, say). Once closed or aborted the backend refuses every call with a
clear error; it never creates a communicator again (that would broadcast a unique id the other
ranks are not waiting for).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from ..arrays import dtypes
from ..arrays.device import DeviceRuntime
from ..engine.protocol import ReduceOp
from ..errors import NcclError
from ..executors.plan import Traits
from . import nccl_api as nccl

#: NCCL dtype names for moving bytes without arithmetic (broadcast, allgather), by item size.
_COPY_DTYPES = {1: "uint8", 2: "float16", 4: "int32", 8: "int64"}


def traits(version: tuple[int, int, int] | None = None) -> Traits:
    """What NCCL reduces natively: every dtype but the 16-bit integers (16-bit floats in 16 bits,
    bool as 0/1 uint8), and from NCCL 2.10 on it averages floating dtypes itself (ncclAvg)."""
    averages = frozenset(dtypes.FLOATING) if nccl.averages("float32", version) else frozenset()
    return Traits(frozenset(dtypes.SUPPORTED) - {"int16", "uint16"}, averages)


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
        self._lock = threading.Lock()
        self.closed: str | None = None  # why the backend was closed or aborted
        self.traits = traits()

    @contextmanager
    def _using(self, what: str) -> Iterator[None]:
        with self._lock:
            if self.closed is not None:
                raise NcclError(f"{what}: the NCCL communicators were {self.closed}", call=what)
            yield

    def _communicator(self, device: int) -> nccl.Communicator:
        """This rank's communicator on ``device`` (the current CUDA device), created on first use.
        Collective over the coordinator's communicator: every rank calls it at the same point."""
        comm = self._comms.get(device)
        if comm is None:
            uid = nccl.unique_id() if self._rank == 0 else None
            uid = self._mpi.bcast(uid, root=0)
            comm = self._comms[device] = nccl.Communicator.init_rank(self._size, uid, self._rank)
        return comm

    def allreduce(self, runtime: DeviceRuntime, device: int, stream: Any,
                  buffers: list[tuple[Any, np.dtype, ReduceOp, bool]]) -> None:
        """In-place ncclAllReduce of each (1-d buffer, its dtype, op, logical: 0/1 bool data), all
        in one group; Average only where :attr:`traits` says NCCL divides (ncclAvg). Empty
        buffers are skipped (their counts are the same on every rank)."""
        with self._using("ncclAllReduce"):
            comm = self._communicator(device)
            cuda_stream = runtime.stream_pointer(stream)
            with nccl.group():
                for buffer, dtype, op, logical in buffers:
                    if _count(buffer):
                        pointer = runtime.pointer(buffer)
                        name = "bool" if logical else dtypes.dtype_name(dtype)
                        comm.allreduce(pointer, pointer, _count(buffer), name, op, cuda_stream)

    def broadcast(self, runtime: DeviceRuntime, device: int, stream: Any, buffer: Any,
                  dtype: np.dtype, root: int) -> None:
        """In-place ncclBroadcast of the 1-d ``buffer`` (of ``dtype``) from ``root``."""
        with self._using("ncclBroadcast"):
            comm = self._communicator(device)
            if _count(buffer):
                pointer = runtime.pointer(buffer)
                comm.broadcast(pointer, pointer, _count(buffer), _COPY_DTYPES[dtype.itemsize], root,
                               runtime.stream_pointer(stream))

    def allgather(self, runtime: DeviceRuntime, device: int, stream: Any, send: Any, recv: Any,
                  dtype: np.dtype, counts: list[int]) -> None:
        """Allgatherv: rank r contributes ``counts[r]`` elements; ``recv`` holds them in rank order.
        One ncclBroadcast per rank with rows inside one group (NCCL's allgather needs equal counts)."""
        with self._using("ncclBroadcast"):
            comm = self._communicator(device)
            cuda_stream = runtime.stream_pointer(stream)
            base, offset = runtime.pointer(recv) if _count(recv) else 0, 0
            with nccl.group():
                for root, count in enumerate(counts):
                    target = base + offset * dtype.itemsize
                    source = runtime.pointer(send) if root == self._rank else target
                    if count:
                        comm.broadcast(source, target, count, _COPY_DTYPES[dtype.itemsize], root,
                                       cuda_stream)
                    offset += count

    def async_error(self) -> str | None:
        """NCCL's asynchronous error of any communicator (a failed peer, a network error), else None."""
        with self._lock:
            for device, comm in list(self._comms.items()):
                error = comm.async_error()
                if error is not None:
                    return f"NCCL communicator on device {device}: {error}"
        return None

    @staticmethod
    def peer_failed(error: str) -> bool:
        """Whether the asynchronous ``error`` says a peer failed (ncclRemoteError: "remote process
        exited or there was a network error"); NCCL does not say which rank."""
        return f"(ncclResult_t {nccl.REMOTE_ERROR})" in error

    def close(self, abort: bool = False) -> None:
        """Destroy every communicator (ncclCommDestroy), or abort them (ncclCommAbort: after an
        error, without waiting for their work); from then on every call raises. Any thread."""
        with self._lock:
            if self.closed is not None:
                return
            self.closed = "aborted after an error" if abort else "destroyed at shutdown"
            comms, self._comms = self._comms, {}
            for comm in comms.values():
                comm.abort() if abort else comm.destroy()


def _count(buffer: Any) -> int:
    return math.prod(buffer.shape)
