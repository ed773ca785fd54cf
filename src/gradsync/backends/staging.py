"""The MPI staging backend for device buffers (GRADSYNC_GPU_OPERATIONS=MPI).

Each device buffer is copied into a page-locked host buffer on the coordinator's CUDA stream, the
coordinator waits for that copy, reduces the host buffer with the :class:`~gradsync.backends.mpi.MpiBackend`,
and copies the result back on the same stream. Nothing needs NCCL, and several ranks may share one
GPU. The coordinator thread blocks during the copies; the training thread does not.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import dtypes
from ..device import DeviceRuntime
from ..fusion import FusionBuffers
from ..protocol import ReduceOp
from .mpi import MpiBackend


class StagingBackend:
    """Device collectives through pinned host buffers and MPI; see the module docstring."""

    name = "MPI (staged through pinned host memory)"
    accumulator = staticmethod(dtypes.accumulator)

    def __init__(self, mpi: MpiBackend) -> None:
        self._mpi = mpi
        self._size = mpi.comm.Get_size()
        # Pinned host buffers, reused per (runtime, use, dtype), grown on demand.
        self._pinned = FusionBuffers(lambda key, count: key[0].pinned(key[2], count))

    def _host(self, runtime: DeviceRuntime, use: str, dtype: np.dtype, count: int) -> np.ndarray:
        """A pinned buffer of ``count`` elements for ``use`` ("reduce", "send", "receive")."""
        return self._pinned.get((runtime, use, dtype), count)

    def _down(self, runtime: DeviceRuntime, stream: Any, source: Any, dtype: np.dtype,
              use: str) -> np.ndarray:
        """Copy the device ``source`` (of ``dtype``) into pinned memory and wait for the copy."""
        host = self._host(runtime, use, dtype, _count(source))
        runtime.to_host(source, host)
        done = runtime.event()
        runtime.record(done, stream)
        runtime.synchronize(done)
        return host

    def allreduce(self, runtime: DeviceRuntime, device: int, stream: Any,
                  buffers: list[tuple[Any, np.dtype, ReduceOp, bool]]) -> list[bool]:
        """Allreduce each (1-d device buffer, its dtype, op, logical: 0/1 bool data) in place through
        host memory. Returns False for each (an Average is a Sum here: the caller divides)."""
        for buffer, dtype, op, logical in buffers:
            host = self._down(runtime, stream, buffer, dtype, "reduce")
            self._mpi.allreduce(host, op, logical)
            runtime.to_device(host, buffer)
        return [False] * len(buffers)

    def broadcast(self, runtime: DeviceRuntime, device: int, stream: Any, buffer: Any,
                  dtype: np.dtype, root: int) -> None:
        """MPI_Bcast of the 1-d device ``buffer`` from ``root``, through host memory."""
        host = self._down(runtime, stream, buffer, dtype, "reduce")
        self._mpi.broadcast(host, root)
        runtime.to_device(host, buffer)

    def allgather(self, runtime: DeviceRuntime, device: int, stream: Any, send: Any, recv: Any,
                  dtype: np.dtype, counts: list[int]) -> None:
        """MPI_Allgatherv of device buffers: rank r contributes ``counts[r]`` elements."""
        host_send = self._down(runtime, stream, send, dtype, "send")
        host_recv = self._host(runtime, "receive", dtype, sum(counts))
        self._mpi.allgather(host_send, host_recv, [c * dtype.itemsize for c in counts])
        runtime.to_device(host_recv, recv)

    def async_error(self) -> str | None:
        """MPI reports its errors itself: always None."""
        return None

    def close(self, abort: bool = False) -> None:
        self._pinned.clear()


def _count(buffer: Any) -> int:
    return math.prod(buffer.shape)
