"""The :class:`gradsync.arrays.device.DeviceRuntime` of torch CUDA tensors (imported on first use).

Streams and events are ``torch.cuda.Stream`` and ``torch.cuda.Event``; device buffers are allocated
by torch's caching allocator, and :meth:`TorchDevice.keep_alive` is ``Tensor.record_stream``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import torch

from ..arrays import dtypes
from .views import numpy_view

_TORCH_DTYPES = {np.dtype(np.float16): torch.float16,  # bfloat16: torch_dtype (no ml_dtypes import here)
                 np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64,
                 np.dtype(np.uint8): torch.uint8, np.dtype(np.int8): torch.int8,
                 np.dtype(np.int16): torch.int16, np.dtype(np.int32): torch.int32,
                 np.dtype(np.int64): torch.int64, np.dtype(np.uint16): torch.uint16,
                 np.dtype(np.uint32): torch.uint32, np.dtype(np.uint64): torch.uint64,
                 np.dtype(np.bool_): torch.bool}


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    """The torch dtype of a numpy dtype of :data:`gradsync.arrays.dtypes.NUMPY_DTYPES`."""
    dtype = np.dtype(dtype)
    return torch.bfloat16 if dtypes.is_bfloat16(dtype) else _TORCH_DTYPES[dtype]


class TorchDevice:
    """torch.cuda streams, events and tensors; see :class:`gradsync.arrays.device.DeviceRuntime`."""

    name = "torch"

    def view(self, x: torch.Tensor) -> torch.Tensor:
        return x.detach()

    def device_index(self, x: torch.Tensor) -> int:
        return x.device.index if x.device.index is not None else torch.cuda.current_device()

    def current_stream(self, device: int) -> torch.cuda.Stream:
        return torch.cuda.current_stream(device)

    def new_stream(self, device: int) -> torch.cuda.Stream:
        # torch.cuda.Stream() hands out streams from a small per-priority pool, round-robin, shared
        # with user code; the high-priority pool is rarely drawn from there, and communication
        # kernels should be scheduled first anyway.
        return torch.cuda.Stream(device, priority=-1)

    def bind(self, device: int) -> None:
        torch.cuda.set_device(device)

    def stream_pointer(self, stream: torch.cuda.Stream) -> int:
        return stream.cuda_stream

    @contextlib.contextmanager
    def on_stream(self, stream: torch.cuda.Stream, device: int):
        with torch.cuda.device(device), torch.cuda.stream(stream):  # NCCL takes the current device
            yield

    def event(self, device: int, timing: bool = False) -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=timing)  # created on the device it is first recorded on

    def record(self, event: torch.cuda.Event, stream: torch.cuda.Stream) -> None:
        event.record(stream)

    def wait(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        stream.wait_event(event)

    def query(self, event: torch.cuda.Event) -> bool:
        return event.query()

    def synchronize(self, event: torch.cuda.Event) -> None:
        event.synchronize()

    def elapsed_ms(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end)

    def empty(self, device: int, dtype: np.dtype, count: int) -> torch.Tensor:
        return torch.empty(count, dtype=torch_dtype(dtype), device=torch.device("cuda", device))

    def from_host(self, device: int, host: np.ndarray) -> torch.Tensor:
        tensor = self.empty(device, host.dtype, host.size)
        tensor.copy_(_host_tensor(host.reshape(-1)))
        return tensor.view(host.shape)

    def pointer(self, array: torch.Tensor) -> int:
        return array.data_ptr()

    def is_contiguous(self, array: torch.Tensor) -> bool:
        return array.is_contiguous()

    def flat(self, array: torch.Tensor) -> torch.Tensor:
        return array.view(-1)

    def copy(self, source: torch.Tensor, target: torch.Tensor, scale: float) -> None:
        if source.shape != target.shape:  # a 1-d buffer slice is viewed in the tensor's shape
            if target.dim() == 1:
                target = target.view(source.shape)
            else:
                source = source.view(target.shape)
        if scale == 1.0:
            target.copy_(source)
        elif source.element_size() <= target.element_size():  # in the target's (wider) precision
            torch.mul(source.to(target.dtype), scale, out=target)
        else:  # in the source's precision, rounded once into the target
            target.copy_(torch.mul(source, scale))

    def floor_divide(self, array: torch.Tensor, divisor: int) -> None:
        array.div_(divisor, rounding_mode="floor")

    def pinned(self, dtype: np.dtype, count: int) -> np.ndarray:
        tensor = torch.empty(count, dtype=torch_dtype(dtype), pin_memory=True)
        return numpy_view(tensor)

    def to_host(self, source: torch.Tensor, target: np.ndarray) -> None:
        _host_tensor(target).copy_(source, non_blocking=True)

    def to_device(self, source: np.ndarray, target: torch.Tensor) -> None:
        target.copy_(_host_tensor(source), non_blocking=True)

    def keep_alive(self, array: Any, stream: torch.cuda.Stream) -> None:
        array.record_stream(stream)


def _host_tensor(array: np.ndarray) -> torch.Tensor:
    """A torch view of a host numpy array (pinned or not), bfloat16 included."""
    if dtypes.is_bfloat16(array.dtype):
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


DEVICE = TorchDevice()
