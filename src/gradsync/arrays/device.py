"""The device-runtime protocol: what the coordinator needs from a GPU framework, and nothing more.

The core never imports torch or cupy. A tensor in device memory comes with a :class:`DeviceRuntime`
from its framework's adapter (``gradsync.torch.device`` for torch tensors, ``gradsync.cupy`` for
CuPy arrays, each imported when such an array is first seen); the coordinator drives streams,
events, device buffers and copy primitives through it (the pack and unpack built on them are
:mod:`gradsync.engine.fusion`'s, the same as on the host). Streams and events are the framework's own objects
(``torch.cuda.Stream``/``torch.cuda.Event``, ``cupy.cuda.Stream``/``cupy.cuda.Event``), so
gradsync's work is ordered against the user's with the framework's own machinery.

Ordering contract (CUDA stream semantics): every device operation below is *enqueued* on the stream
given (or the stream made current by :meth:`DeviceRuntime.on_stream`) and returns before it ran;
only :meth:`DeviceRuntime.synchronize` blocks the host.
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

import numpy as np


class DeviceRuntime(Protocol):
    """Streams, events, buffers and copies of one GPU framework (see the module docstring).

    ``device`` arguments are CUDA device indices (int). Device arrays are the framework's arrays;
    ``dtype`` arguments are numpy dtypes (bfloat16 is ``ml_dtypes.bfloat16``).
    """

    name: str  #: the framework, e.g. "torch", "cupy": named in errors

    def view(self, x: Any) -> Any:
        """``x``, or a view sharing its memory that gradsync may write (torch: ``x.detach()``)."""

    def device_index(self, x: Any) -> int:
        """The CUDA device index of the device array ``x``."""

    def current_stream(self, device: int) -> Any:
        """The caller's current stream on ``device`` (where the framework enqueues its kernels)."""

    def new_stream(self, device: int) -> Any:
        """A stream on ``device`` of gradsync's own: not the legacy default stream, not synchronised
        with it, and not one the framework hands to user code too (torch: a high-priority stream,
        whose pool user code rarely draws from)."""

    def bind(self, device: int) -> None:
        """Make ``device`` the calling thread's current CUDA device (before a thread of gradsync's
        touches events or streams: otherwise CUDA creates a context on device 0 for it)."""

    def stream_pointer(self, stream: Any) -> int:
        """The ``cudaStream_t`` of ``stream`` as an integer (what NCCL takes)."""

    def on_stream(self, stream: Any, device: int) -> contextlib.AbstractContextManager:
        """Context in which ``device`` and its ``stream`` are current: framework work goes onto it."""

    def event(self, device: int, timing: bool = False) -> Any:
        """A new event on ``device`` (record it only on that device's streams); ``timing``: it can
        be used with :meth:`elapsed_ms`."""

    def record(self, event: Any, stream: Any) -> None:
        """Record ``event`` on ``stream``: it completes when the work enqueued before it has run."""

    def wait(self, stream: Any, event: Any) -> None:
        """Make ``stream`` wait for ``event`` (cudaStreamWaitEvent); the host does not block."""

    def query(self, event: Any) -> bool:
        """True when ``event`` has completed; never blocks."""

    def synchronize(self, event: Any) -> None:
        """Block the host until ``event`` has completed."""

    def elapsed_ms(self, start: Any, end: Any) -> float:
        """Milliseconds between two completed timing events."""

    def empty(self, device: int, dtype: np.dtype, count: int) -> Any:
        """A new 1-d device array of ``count`` elements (contents undefined), allocated on the
        current stream."""

    def from_host(self, device: int, host: np.ndarray) -> Any:
        """A new device array holding a copy of ``host`` (same shape and dtype)."""

    def pointer(self, array: Any) -> int:
        """The device address of ``array``'s first element."""

    def is_contiguous(self, array: Any) -> bool:
        """Whether ``array`` is C-contiguous (can be handed to NCCL as it is)."""

    def flat(self, array: Any) -> Any:
        """A 1-d view of the C-contiguous ``array`` sharing its memory."""

    def copy(self, source: Any, target: Any, scale: float) -> None:
        """Enqueue ``target[...] = source * scale`` on the current stream, cast to ``target``'s
        dtype and computed in the wider of the two dtypes; as :meth:`gradsync.executors.memory.Memory.copy`
        (one side may be a 1-d buffer slice, viewed in the other's shape)."""

    def floor_divide(self, array: Any, divisor: int) -> None:
        """Enqueue ``array //= divisor`` (an integer array, in place) on the current stream."""

    def pinned(self, dtype: np.dtype, count: int) -> np.ndarray:
        """A 1-d numpy array of ``count`` elements in page-locked host memory."""

    def to_host(self, source: Any, target: np.ndarray) -> None:
        """Enqueue the copy of the 1-d device array ``source`` into pinned ``target``."""

    def to_device(self, source: np.ndarray, target: Any) -> None:
        """Enqueue the copy of pinned ``source`` into the 1-d device array ``target``."""

    def keep_alive(self, array: Any, stream: Any) -> None:
        """Tell the framework's caching allocator that ``stream`` uses ``array``, so its memory is
        not reused before the work enqueued on ``stream`` so far has run (torch's record_stream)."""


def resolve_gpu_operations(setting: str, nccl_loads: bool) -> str:
    """``"nccl"`` or ``"mpi"``: GRADSYNC_GPU_OPERATIONS (validated by :mod:`gradsync.config`), or,
    when it is empty, NCCL if the library loads."""
    value = setting.strip().lower()
    if value:
        return value
    return "nccl" if nccl_loads else "mpi"


def device_kind(device: str) -> str:
    """``"cpu"`` or ``"cuda"`` from a device string ('cuda:1' -> 'cuda')."""
    return device.partition(":")[0]
