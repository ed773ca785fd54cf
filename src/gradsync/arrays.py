"""Framework-agnostic access to tensors: numpy arrays, torch tensors, any DLPack / array-API array.

The core works on host (CPU) memory through numpy *views* that share memory with the caller's
tensor, so in-place operations write straight into it. Tensors in GPU memory are handed to the
coordinator as they are, with their framework's :class:`gradsync.device.DeviceRuntime`. An
:class:`ArrayAdapter` per framework says how to get that view, the tensor's dtype, shape and device,
and how to allocate an output of the same kind. The torch adapter lives in :mod:`gradsync.torch` and
is imported only when a torch tensor is first seen, so the core never imports a deep-learning
framework.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from . import dtypes

if TYPE_CHECKING:
    from .device import DeviceRuntime


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """What negotiation needs to know about a tensor: dtype name, shape and device string."""

    dtype: str
    shape: tuple[int, ...]
    device: str


class ArrayAdapter(Protocol):
    """How gradsync reads and allocates the arrays of one framework."""

    def info(self, x: Any) -> TensorInfo:
        """dtype name (see :mod:`gradsync.dtypes`), shape and device ('cpu', 'cuda:0', ...) of ``x``."""

    def host_view(self, x: Any) -> np.ndarray:
        """A writable numpy view sharing memory with ``x`` (which must be in host memory)."""

    def empty(self, like: Any, shape: tuple[int, ...]) -> Any:
        """A new uninitialised, C-contiguous array of ``shape`` with the dtype and device of ``like``."""

    def from_host(self, like: Any, array: np.ndarray) -> Any:
        """``array`` (a numpy array) as an array of ``like``'s framework, in host memory."""

    def device_runtime(self, x: Any) -> DeviceRuntime | None:
        """The :class:`gradsync.device.DeviceRuntime` of ``x``'s framework when ``x`` is in device
        memory; None for host arrays."""


class NumpyAdapter:
    """numpy.ndarray: the view is the array itself."""

    def info(self, x: np.ndarray) -> TensorInfo:
        return TensorInfo(dtypes.dtype_name(x.dtype), tuple(x.shape), "cpu")

    def host_view(self, x: np.ndarray) -> np.ndarray:
        return x

    def empty(self, like: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        return np.empty(shape, dtype=like.dtype)

    def from_host(self, like: np.ndarray, array: np.ndarray) -> np.ndarray:
        return array

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

    def device_runtime(self, x: Any) -> None:
        return None  # device arrays of other frameworks are refused by gradsync.ops


_NUMPY = NumpyAdapter()
_DLPACK = DLPackAdapter()


def adapter_for(x: Any, name: str | None = None) -> ArrayAdapter:
    """The adapter for ``x``'s framework: numpy, torch (``gradsync.torch.array``), CuPy
    (``gradsync.cupy``), JAX (``gradsync.jax.array``; each imported on first sight), an array
    type that names its own adapter in a ``__gradsync_adapter__`` class attribute, or any
    DLPack/array-API array.

    Raises:
        TypeError: ``x`` is not an array gradsync can read (message names the tensor ``name``).
    """
    if isinstance(x, np.ndarray):
        return _NUMPY
    module = type(x).__module__.partition(".")[0]
    if module == "torch":
        return importlib.import_module("gradsync.torch.array").TORCH
    if module == "cupy":
        return importlib.import_module("gradsync.cupy").ADAPTER
    if module in ("jax", "jaxlib"):  # jax.Array (jaxlib's ArrayImpl) and jax's tracers
        return importlib.import_module("gradsync.jax.array").ADAPTER
    own = getattr(type(x), "__gradsync_adapter__", None)
    if own is not None:
        return own
    if hasattr(x, "__dlpack__") and hasattr(x, "__array_namespace__"):
        return _DLPACK
    label = f"tensor {name!r}" if name else "the tensor"
    raise TypeError(f"gradsync: {label} is a {type(x).__module__}.{type(x).__qualname__}; expected a "
                    f"numpy array, a torch tensor or an array-API array with __dlpack__")
