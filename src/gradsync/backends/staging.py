"""The MPI staging backend for device buffers (GRADSYNC_GPU_OPERATIONS=MPI).

Each device buffer is copied into a page-locked host buffer on the coordinator's CUDA stream, the
coordinator waits for that copy, reduces the host buffer with the :class:`~gradsync.backends.mpi.MpiBackend`,
and copies the result back on the same stream. Nothing needs NCCL, and several ranks may share one
GPU. The coordinator thread blocks during the copies; the training thread does not.

The pinned buffers are reused and grown on demand. The copy back to the device is asynchronous, so
before a buffer is replaced by a larger one the stream is waited for: the old buffer's memory must
not return to the framework's pinned pool while a copy still reads it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from ..arrays.device import DeviceRuntime
from ..engine.protocol import ReduceOp
from ..executors.memory import FusionBuffers
from .mpi import MpiBackend


class StagingBackend:
    """Device collectives through pinned host buffers and MPI; see the module docstring."""

    name = "MPI (staged through pinned host memory)"
    #: MPI's dtypes; a device tensor's input is staged whole (no separate source is read).
    traits = dataclasses.replace(MpiBackend.traits, reduces_from_source=False)
    closed: str | None = None  # never closed by an error: MPI reports its errors itself

    def __init__(self, mpi: MpiBackend) -> None:
        self._mpi = mpi
        self._size = mpi.comm.Get_size()
        # Pinned host buffers, reused per (runtime, use, dtype), grown on demand.
        self._pinned = FusionBuffers(lambda key, count: key[0].pinned(key[2], count))

    def _host(self, runtime: DeviceRuntime, device: int, stream: Any, use: str, dtype: np.dtype,
              count: int) -> np.ndarray:
        """A pinned buffer of ``count`` elements for ``use`` ("reduce", "send", "receive"); before
        growing one, wait for the stream's copies from the old one."""
        key = (runtime, use, dtype)
        if not self._pinned.fits(key, count):
            _wait(runtime, device, stream)
        return self._pinned.get(key, count)

    def _down(self, runtime: DeviceRuntime, device: int, stream: Any, source: Any, dtype: np.dtype,
              use: str) -> np.ndarray:
        """Copy the device ``source`` (of ``dtype``) into pinned memory and wait for the copy."""
        host = self._host(runtime, device, stream, use, dtype, _count(source))
        runtime.to_host(source, host)
        _wait(runtime, device, stream)
        return host

    def allreduce(self, runtime: DeviceRuntime, device: int, stream: Any,
                  buffers: list[tuple[Any, np.dtype, ReduceOp, bool]]) -> None:
        """Allreduce each (1-d device buffer, its dtype, op, logical: 0/1 bool data) in place through
        host memory (same semantics as MPI_Allreduce)."""
        for buffer, dtype, op, logical in buffers:
            host = self._down(runtime, device, stream, buffer, dtype, "reduce")
            self._mpi.allreduce(host, op, logical)
            runtime.to_device(host, buffer)

    def broadcast(self, runtime: DeviceRuntime, device: int, stream: Any, buffer: Any,
                  dtype: np.dtype, root: int) -> None:
        """MPI_Bcast of the 1-d device ``buffer`` from ``root``, through host memory."""
        host = self._down(runtime, device, stream, buffer, dtype, "reduce")
        self._mpi.broadcast(host, root)
        runtime.to_device(host, buffer)

    def allgather(self, runtime: DeviceRuntime, device: int, stream: Any, send: Any, recv: Any,
                  dtype: np.dtype, counts: list[int]) -> None:
        """MPI_Allgatherv of device buffers: rank r contributes ``counts[r]`` elements."""
        host_send = self._down(runtime, device, stream, send, dtype, "send")
        host_recv = self._host(runtime, device, stream, "receive", dtype, sum(counts))
        self._mpi.allgather(host_send, host_recv, [c * dtype.itemsize for c in counts])
        runtime.to_device(host_recv, recv)

    def async_error(self) -> str | None:
        """MPI reports its errors itself: always None."""
        return None

    def close(self, abort: bool = False) -> None:
        self._pinned.clear()


def _wait(runtime: DeviceRuntime, device: int, stream: Any) -> None:
    """Block until the work enqueued on ``stream`` so far has run."""
    done = runtime.event(device)
    runtime.record(done, stream)
    runtime.synchronize(done)


def _count(buffer: Any) -> int:
    return math.prod(buffer.shape)
