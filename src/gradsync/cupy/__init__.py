"""CuPy arrays: their :class:`gradsync.arrays.adapter.ArrayAdapter` and
:class:`gradsync.arrays.device.DeviceRuntime`.

Imported when gradsync first sees a ``cupy.ndarray``; ``import gradsync`` never imports CuPy.
Streams and events are ``cupy.cuda.Stream`` and ``cupy.cuda.Event``; host copies use
``cudaMemcpyAsync`` on the stream given. CuPy's memory pool has no ``record_stream``: gradsync keeps
a reference to every array its communication stream uses until that work has completed.
"""

from __future__ import annotations

import contextlib
from typing import Any

import cupy
import cupyx
import numpy as np

from ..arrays import dtypes
from ..arrays.adapter import TensorInfo, register


class CupyAdapter:
    """cupy.ndarray: always in device memory (so never a host view)."""

    def info(self, x: cupy.ndarray) -> TensorInfo:
        return TensorInfo(dtypes.dtype_name(x.dtype), tuple(x.shape), f"cuda:{x.device.id}")

    def host_view(self, x: cupy.ndarray) -> np.ndarray:
        raise TypeError("a CuPy array is in device memory; it has no host view")

    def empty(self, like: cupy.ndarray, shape: tuple[int, ...]) -> cupy.ndarray:
        with like.device:
            return cupy.empty(shape, dtype=like.dtype)

    def from_host(self, like: cupy.ndarray, array: np.ndarray) -> np.ndarray:
        return array  # CuPy has no host arrays: small host results (alltoall's splits) stay numpy

    def cast(self, x: cupy.ndarray, dtype: str) -> cupy.ndarray:
        with x.device:
            return x.astype(dtypes.NUMPY_DTYPES[dtype])

    def device_runtime(self, x: cupy.ndarray) -> CupyDevice:
        return DEVICE


class CupyDevice:
    """cupy.cuda streams, events and arrays; see :class:`gradsync.arrays.device.DeviceRuntime`."""

    name = "cupy"

    def view(self, x: cupy.ndarray) -> cupy.ndarray:
        return x

    def device_index(self, x: cupy.ndarray) -> int:
        return x.device.id

    def current_stream(self, device: int) -> cupy.cuda.Stream:
        with cupy.cuda.Device(device):
            return cupy.cuda.get_current_stream()

    def new_stream(self, device: int) -> cupy.cuda.Stream:
        with cupy.cuda.Device(device):
            return cupy.cuda.Stream(non_blocking=True)

    def stream_pointer(self, stream: cupy.cuda.Stream) -> int:
        return stream.ptr

    @contextlib.contextmanager
    def on_stream(self, stream: cupy.cuda.Stream, device: int):
        with cupy.cuda.Device(device), stream:
            yield

    def bind(self, device: int) -> None:
        cupy.cuda.Device(device).use()

    def event(self, device: int, timing: bool = False) -> cupy.cuda.Event:
        with cupy.cuda.Device(device):  # a CuPy event belongs to the device current at creation
            return cupy.cuda.Event(disable_timing=not timing)

    def record(self, event: cupy.cuda.Event, stream: cupy.cuda.Stream) -> None:
        event.record(stream)

    def wait(self, stream: cupy.cuda.Stream, event: cupy.cuda.Event) -> None:
        stream.wait_event(event)

    def query(self, event: cupy.cuda.Event) -> bool:
        return event.done

    def synchronize(self, event: cupy.cuda.Event) -> None:
        event.synchronize()

    def elapsed_ms(self, start: cupy.cuda.Event, end: cupy.cuda.Event) -> float:
        return cupy.cuda.get_elapsed_time(start, end)

    def empty(self, device: int, dtype: np.dtype, count: int) -> cupy.ndarray:
        with cupy.cuda.Device(device):
            return cupy.empty(count, dtype=dtype)

    def from_host(self, device: int, host: np.ndarray) -> cupy.ndarray:
        with cupy.cuda.Device(device):
            return cupy.asarray(host)

    def pointer(self, array: cupy.ndarray) -> int:
        return array.data.ptr

    def is_contiguous(self, array: cupy.ndarray) -> bool:
        return array.flags.c_contiguous

    def flat(self, array: cupy.ndarray) -> cupy.ndarray:
        return array.reshape(-1)

    def copy(self, source: cupy.ndarray, target: cupy.ndarray, scale: float) -> None:
        if source.shape != target.shape:  # a 1-d buffer slice is viewed in the array's shape
            if target.ndim == 1:
                target = target.reshape(source.shape)
            else:
                source = source.reshape(target.shape)
        if scale == 1.0:
            cupy.copyto(target, source, casting="unsafe")
        elif source.dtype.itemsize <= target.dtype.itemsize:  # in the target's (wider) precision
            cupy.multiply(source.astype(target.dtype, copy=False), scale, out=target)
        else:  # in the source's precision, rounded once into the target
            cupy.copyto(target, source * scale, casting="unsafe")

    def floor_divide(self, array: cupy.ndarray, divisor: int) -> None:
        cupy.floor_divide(array, divisor, out=array)

    def pinned(self, dtype: np.dtype, count: int) -> np.ndarray:
        return cupyx.empty_pinned(count, dtype=dtype)

    def to_host(self, source: cupy.ndarray, target: np.ndarray) -> None:
        cupy.cuda.runtime.memcpyAsync(target.ctypes.data, source.data.ptr, target.nbytes,
                                      cupy.cuda.runtime.memcpyDeviceToHost,
                                      cupy.cuda.get_current_stream().ptr)

    def to_device(self, source: np.ndarray, target: cupy.ndarray) -> None:
        cupy.cuda.runtime.memcpyAsync(target.data.ptr, source.ctypes.data, source.nbytes,
                                      cupy.cuda.runtime.memcpyHostToDevice,
                                      cupy.cuda.get_current_stream().ptr)

    def keep_alive(self, array: Any, stream: cupy.cuda.Stream) -> None:
        """Nothing to tell CuPy's pool: the coordinator holds ``array`` until the work is done."""


ADAPTER = CupyAdapter()
DEVICE = CupyDevice()
register("cupy", ADAPTER)
