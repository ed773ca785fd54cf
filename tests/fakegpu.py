"""A fake GPU for CI: device arrays in host memory, streams that really run asynchronously.

It implements gradsync's :class:`gradsync.arrays.device.DeviceRuntime` on numpy, so the coordinator's device
path (routing, fusion on the "device", events, the MPI staging backend, errors) runs without a GPU.
Ordering is real, so a missing event wait is a wrong result, not a silent pass:

* every stream is a worker thread running its queue of operations in order;
* an event is recorded by queueing "set me" on a stream; ``wait(stream, event)`` queues "block
  until set", so later work on that stream runs after the event's stream reached it;
* every data operation (pack, unpack, copies) is queued on the *current* stream of the calling
  thread (``on_stream`` changes it), as CUDA kernels are.

Tests use :func:`later` to make a producer stream fill an array only after a delay, and
:func:`read` to synchronize the caller's stream and copy an array out. ``FakeArray`` is registered
with gradsync through its ``__gradsync_adapter__`` class attribute and reports device ``cuda:N``.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from typing import Any

import numpy as np

from gradsync.arrays import dtypes
from gradsync.arrays.adapter import TensorInfo


class FakeStream:
    """An in-order queue of operations run by its own thread (like a CUDA stream)."""

    def __init__(self, device: int, label: str) -> None:
        self.device, self.label = device, label
        self._queue: queue.Queue = queue.Queue()
        self.ops: list[str] = []  # what ran on this stream, in order (for tests)
        threading.Thread(target=self._run, daemon=True, name=f"fake-stream-{label}").start()

    def enqueue(self, what: str, operation) -> None:
        self._queue.put((what, operation))

    def _run(self) -> None:
        while True:
            what, operation = self._queue.get()
            operation()
            self.ops.append(what)
            self._queue.task_done()

    def idle(self) -> bool:
        """Whether every operation enqueued so far has run."""
        return self._queue.unfinished_tasks == 0


class FakeEvent:
    def __init__(self, device: int, timing: bool = False) -> None:
        self.device = device
        self.flag = threading.Event()
        self.at = 0.0
        self.recorded = False

    def fire(self) -> None:
        self.at = time.perf_counter()
        self.flag.set()


class FakeArray:
    """A "device" array: a numpy array plus the device it lives on."""

    __gradsync_adapter__: Any = None  # set below

    def __init__(self, data: np.ndarray, device: int = 0, stream: FakeStream | None = None) -> None:
        self.data = data
        self.device = device
        self.stream = stream  # the stream that was current when it was allocated (None: unknown)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def dtype(self) -> np.dtype:
        return self.data.dtype

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def __getitem__(self, index) -> FakeArray:
        return FakeArray(self.data[index], self.device, self.stream)

    def reshape(self, *shape) -> FakeArray:
        view = self.data.reshape(*shape)
        assert np.shares_memory(view, self.data) or view.size == 0, "reshape copied"
        return FakeArray(view, self.device, self.stream)

    def __repr__(self) -> str:
        return f"FakeArray(cuda:{self.device}, {self.data!r})"


class FakeAdapter:
    def info(self, x: FakeArray) -> TensorInfo:
        return TensorInfo(dtypes.dtype_name(x.dtype), tuple(x.shape), f"cuda:{x.device}")

    def host_view(self, x: FakeArray) -> np.ndarray:
        raise TypeError("a fake device array has no host view")

    def empty(self, like: FakeArray, shape: tuple[int, ...]) -> FakeArray:
        stream = DEVICE.current_stream(like.device)
        return FakeArray(np.full(shape, 99, like.dtype), like.device, stream)  # garbage, visibly

    def device_runtime(self, x: FakeArray) -> FakeDevice:
        return DEVICE


class FakeDevice:
    """gradsync.arrays.device.DeviceRuntime on numpy and threads (see the module docstring)."""

    name = "fakegpu"

    def __init__(self) -> None:
        self._default: dict[int, FakeStream] = {}
        self._local = threading.local()
        self.streams: list[FakeStream] = []
        self.kept: list[tuple[int, FakeStream]] = []  # keep_alive calls: (id of array, stream)
        self.lock = threading.Lock()
        self.unbound_queries = 0  # query() from a thread whose bound device is not the event's

    # streams and events
    def view(self, x: FakeArray) -> FakeArray:
        return x

    def device_index(self, x: FakeArray) -> int:
        return x.device

    def default_stream(self, device: int) -> FakeStream:
        with self.lock:
            if device not in self._default:
                self._default[device] = FakeStream(device, f"default{device}")
            return self._default[device]

    def current_stream(self, device: int) -> FakeStream:
        stack = getattr(self._local, "stack", [])
        for stream in reversed(stack):
            if stream.device == device:
                return stream
        return self.default_stream(device)

    def new_stream(self, device: int) -> FakeStream:
        stream = FakeStream(device, f"comm{device}.{len(self.streams)}")
        self.streams.append(stream)
        return stream

    def bind(self, device: int) -> None:
        self._local.bound = device

    def stream_pointer(self, stream: FakeStream) -> int:
        return id(stream)

    @contextlib.contextmanager
    def on_stream(self, stream: FakeStream, device: int):
        assert stream.device == device
        stack = self._local.__dict__.setdefault("stack", [])
        stack.append(stream)
        try:
            yield
        finally:
            stack.pop()

    def _current(self) -> FakeStream:
        stack = getattr(self._local, "stack", [])
        return stack[-1] if stack else self.default_stream(0)

    def event(self, device: int, timing: bool = False) -> FakeEvent:
        return FakeEvent(device, timing)

    def record(self, event: FakeEvent, stream: FakeStream) -> None:
        assert event.device == stream.device, "an event recorded on another device's stream"
        event.recorded = True
        stream.enqueue("record", event.fire)

    def wait(self, stream: FakeStream, event: FakeEvent) -> None:
        assert event.recorded, "waiting on an event that was never recorded"
        stream.enqueue("wait", lambda: event.flag.wait(30) or _fail("event never completed"))

    def query(self, event: FakeEvent) -> bool:
        if getattr(self._local, "bound", None) != event.device:
            self.unbound_queries += 1  # on CUDA: a context created on device 0 for this thread
        return event.flag.is_set()

    def synchronize(self, event: FakeEvent) -> None:
        if not event.flag.wait(30):
            _fail("synchronize: event never completed")

    def elapsed_ms(self, start: FakeEvent, end: FakeEvent) -> float:
        return (end.at - start.at) * 1e3

    # memory
    def empty(self, device: int, dtype: np.dtype, count: int) -> FakeArray:
        return FakeArray(np.full(count, 77, dtype), device, self.current_stream(device))

    def from_host(self, device: int, host: np.ndarray) -> FakeArray:
        return FakeArray(host.copy(), device)

    def pointer(self, array: FakeArray) -> int:
        return array.data.ctypes.data

    def is_contiguous(self, array: FakeArray) -> bool:
        return array.data.flags.c_contiguous

    def flat(self, array: FakeArray) -> FakeArray:
        flat = array.data.reshape(-1)
        assert np.shares_memory(flat, array.data) or flat.size == 0
        return FakeArray(flat, array.device)

    def copy(self, source: FakeArray, target: FakeArray, scale: float) -> None:
        def run():
            from gradsync.executors.memory import HOST

            HOST.copy(source.data, target.data, scale)
        self._current().enqueue("copy", run)

    def floor_divide(self, array: FakeArray, divisor: int) -> None:
        self._current().enqueue("floor_divide", lambda: np.floor_divide(array.data, divisor,
                                                                          out=array.data))

    def pinned(self, dtype: np.dtype, count: int) -> np.ndarray:
        return np.full(count, 55, dtype)

    def to_host(self, source: FakeArray, target: np.ndarray) -> None:
        self._current().enqueue("to_host", lambda: np.copyto(target, source.data.reshape(-1)))

    def to_device(self, source: np.ndarray, target: FakeArray) -> None:
        self._current().enqueue("to_device", lambda: np.copyto(target.data.reshape(-1), source))

    def keep_alive(self, array: FakeArray, stream: FakeStream) -> None:
        self.kept.append((id(array), stream))


def _fail(message: str) -> None:
    raise AssertionError(f"fakegpu: {message}")


DEVICE = FakeDevice()
FakeArray.__gradsync_adapter__ = FakeAdapter()


def array(data, device: int = 0) -> FakeArray:
    """A fake device array holding a copy of ``data``, ready at once."""
    return FakeArray(np.array(data), device)


def later(target: FakeArray, values: np.ndarray, delay: float) -> None:
    """On the caller's current stream: sleep ``delay`` s, then write ``values`` into ``target``
    (a producer kernel that finishes late)."""
    def run():
        time.sleep(delay)
        np.copyto(target.data, values)
    DEVICE.current_stream(target.device).enqueue("producer", run)


def read(x: FakeArray) -> np.ndarray:
    """Wait for the caller's current stream (like ``tensor.cpu()``) and return a copy of ``x``."""
    event = FakeEvent(x.device)
    DEVICE.record(event, DEVICE.current_stream(x.device))
    DEVICE.synchronize(event)
    return x.data.copy()
