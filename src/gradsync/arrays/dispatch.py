"""Framework-agnostic access to tensors: numpy arrays, torch tensors, any DLPack / array-API array.

The core works on host (CPU) memory through numpy *views* that share memory with the caller's
tensor, so in-place operations write straight into it. Tensors in GPU memory are handed to the
coordinator as they are, with their framework's :class:`gradsync.arrays.device.DeviceRuntime`. An
:class:`~gradsync.arrays.adapter.ArrayAdapter` per framework says how to get that view, the tensor's dtype,
shape and device, and how to allocate and cast arrays of the same kind. numpy and DLPack arrays are
handled here; the torch and CuPy adapters live in their own packages, which this dispatcher imports
by name (:data:`ADAPTER_MODULES`) only when such an array is first seen, so the core never imports
a deep-learning framework.
"""

from __future__ import annotations

import importlib
import math
from typing import Any

import numpy as np

from . import dtypes
from .adapter import ArrayAdapter, TensorInfo, registered

#: The adapter module of each framework gradsync knows by name, imported on first sight of one of
#: its arrays; importing it registers its adapter (:func:`gradsync.arrays.adapter.register`).
# jax.Array (jaxlib's ArrayImpl) and jax's tracers live in jaxlib and jax.
ADAPTER_MODULES = {"torch": "gradsync.torch.array", "cupy": "gradsync.cupy",
                   "jax": "gradsync.jax.array", "jaxlib": "gradsync.jax.array"}

__all__ = ["ADAPTER_MODULES", "ALIGNMENT", "ArrayAdapter", "DLPackAdapter", "NumpyAdapter", "TensorInfo",
           "adapter_for", "aligned_empty"]


#: Bytes: where new host results start. XLA's CPU client (jax) and TensorFlow (a
#: ``tf.numpy_function``'s outputs inside a graph) take a host buffer in place only when it is
#: aligned to 64 bytes, and copy it otherwise; numpy's own buffers are 16-byte aligned.
ALIGNMENT = 64


def aligned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A new C-contiguous numpy array of ``shape`` and ``dtype`` whose data starts on a multiple of
    :data:`ALIGNMENT` bytes (contents undefined)."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize  # math.prod: np.prod costs microseconds per call
    raw = np.empty(nbytes + ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start:start + nbytes].view(dtype).reshape(shape)


class NumpyAdapter:
    """numpy.ndarray: the view is the array itself; new arrays (results) are 64-byte aligned
    (:func:`aligned_empty`), so a framework that imports them takes them without a copy."""

    def info(self, x: np.ndarray) -> TensorInfo:
        return TensorInfo(dtypes.dtype_name(x.dtype), tuple(x.shape), "cpu")

    def host_view(self, x: np.ndarray) -> np.ndarray:
        return x

    def empty(self, like: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        return aligned_empty(shape, like.dtype)

    def from_host(self, like: np.ndarray, array: np.ndarray) -> np.ndarray:
        return array

    def cast(self, x: np.ndarray, dtype: str) -> np.ndarray:
        return x.astype(dtypes.NUMPY_DTYPES[dtype])

    def device_runtime(self, x: np.ndarray) -> None:
        return None


class DLPackAdapter:
    """Any array with ``__dlpack__`` and ``__array_namespace__`` (array API standard), on the CPU."""

    def info(self, x: Any) -> TensorInfo:
        device_type, device_id = x.__dlpack_device__()
        device = "cpu" if int(device_type) == 1 else f"dlpack:{int(device_type)}:{device_id}"
        if device != "cpu":
            return TensorInfo(str(x.dtype), tuple(x.shape), device)
        return TensorInfo(dtypes.dtype_name(np.from_dlpack(x).dtype), tuple(x.shape), device)

    def host_view(self, x: Any) -> np.ndarray:
        return np.from_dlpack(x)

    def empty(self, like: Any, shape: tuple[int, ...]) -> Any:
        return like.__array_namespace__().empty(shape, dtype=like.dtype)

    def from_host(self, like: Any, array: np.ndarray) -> Any:
        return like.__array_namespace__().asarray(array)

    def cast(self, x: Any, dtype: str) -> Any:
        namespace = x.__array_namespace__()
        return namespace.astype(x, getattr(namespace, dtype))

    def device_runtime(self, x: Any) -> None:
        return None  # device arrays of other frameworks are refused by gradsync.ops


_NUMPY = NumpyAdapter()
_DLPACK = DLPackAdapter()


#: The adapter of each array type seen so far whose module names a framework of
#: :data:`ADAPTER_MODULES` (a type's module and a registration never change): one dict lookup per op.
_FRAMEWORK_TYPES: dict[type, ArrayAdapter] = {}


def adapter_for(x: Any, name: str | None = None) -> ArrayAdapter:
    """The adapter for ``x``'s framework: numpy, one of :data:`ADAPTER_MODULES` (torch, CuPy, JAX:
    imported on first sight, where they register themselves), an array type that names its own adapter in a
    ``__gradsync_adapter__`` class attribute, or any DLPack/array-API array.

    Raises:
        TypeError: ``x`` is not an array gradsync can read (message names the tensor ``name``).
    """
    if isinstance(x, np.ndarray):
        return _NUMPY
    adapter = _FRAMEWORK_TYPES.get(type(x))
    if adapter is not None:
        return adapter
    framework = type(x).__module__.partition(".")[0]
    if framework in ADAPTER_MODULES:
        adapter = registered(framework)
        if adapter is None:
            importlib.import_module(ADAPTER_MODULES[framework])  # registers it
            adapter = registered(framework)
        _FRAMEWORK_TYPES[type(x)] = adapter
        return adapter
    own = getattr(type(x), "__gradsync_adapter__", None)
    if own is not None:
        return own
    if hasattr(x, "__dlpack__") and hasattr(x, "__array_namespace__"):
        return _DLPACK
    label = f"tensor {name!r}" if name else "the tensor"
    raise TypeError(f"gradsync: {label} is a {type(x).__module__}.{type(x).__qualname__}; expected a "
                    f"numpy array, a torch tensor or an array-API array with __dlpack__")
