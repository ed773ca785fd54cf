"""jax.Array to and from the host memory the core moves; the core's adapter for jax arrays.

Imported when gradsync first sees a jax array (``gradsync.arrays.dispatch.adapter_for``) or when
``gradsync.jax`` is imported. Copies, measured with ``unsafe_buffer_pointer`` (tests/test_jax.py):

* **In:** a jax array on the CPU is read where it lies: ``numpy.asarray`` of it is a read-only
  view of XLA's buffer (bfloat16 included, through ml_dtypes). An array on another device (a GPU)
  is copied to the host once (*staging*): the core moves host memory with MPI.
* **Out:** results are written into new host buffers aligned to 64 bytes, which one
  ``jax.device_put(..., may_alias=True)`` for all of a pytree's leaves turns into jax arrays
  without a copy (XLA's CPU client imports only buffers aligned to 64 bytes; numpy's own are
  16-aligned). Dtypes that jax narrows (int64 and float64 while ``jax_enable_x64`` is off) are
  copied once; so is a result for an array on another device (a GPU), to that device.
  (``jax.dlpack.from_dlpack`` imports in place too, but costs more per array and does not carry
  bfloat16.)

jax arrays are immutable, so the host view is always read-only and the core refuses in-place ops
on them (``allreduce_`` and the like) with an error that names the op to use instead.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from ..arrays import dtypes
from ..arrays.adapter import TensorInfo, register
from ..arrays.dispatch import ALIGNMENT as ALIGNMENT  # what XLA's CPU client imports in place
from ..arrays.dispatch import aligned_empty


def check_concrete(x: Any, what: str) -> None:
    """Refuse a traced value where a concrete array is needed.

    Raises:
        TypeError: ``x`` is a jax tracer (inside ``jax.jit``, ``vmap``, ``grad``, ...).
    """
    if isinstance(x, jax.core.Tracer):
        raise TypeError(f"{what} got a traced jax value (inside jax.jit, vmap, grad or a control-flow "
                        "primitive); gradsync's core ops need concrete arrays. Inside jax.jit use "
                        "gradsync.jax.allreduce, grouped_allreduce, broadcast or allgather (they run "
                        "through an XLA custom call or an ordered io_callback), or call the op "
                        "outside the traced function")


def single_device(x: jax.Array, what: str) -> jax.Device:
    """The one device that holds ``x``.

    Raises:
        TypeError: ``x`` is sharded over several devices (gradsync runs one process per device).
    """
    devices = x.devices()
    if len(devices) != 1:
        raise TypeError(f"{what}: the jax array is sharded over {len(devices)} devices "
                        f"({sorted(str(d) for d in devices)}); gradsync runs one process per device, "
                        "so each rank passes an array on a single device")
    return next(iter(devices))


def host_view(x: Any) -> np.ndarray:
    """A read-only numpy array of ``x``'s values: a view of a CPU jax array (no copy), one host
    copy of an array on another device, a numpy array as it is (results are the core's own
    buffers). Blocks until ``x`` is computed (jax dispatches asynchronously)."""
    if isinstance(x, np.ndarray):
        return x
    view = np.asarray(x)
    if view.flags.writeable:  # a staged copy: in place would write into a copy nobody reads
        view = view.view()
        view.flags.writeable = False
    return view


def to_jax(results: list[np.ndarray], devices: list[jax.Device | None]) -> list[jax.Array]:
    """The host arrays ``results`` (which nobody writes any more) as jax arrays, each on its
    device (None: jax's default device); one batched ``jax.device_put``, which imports each
    aligned CPU buffer in place instead of copying it (module docstring)."""
    try:
        return jax.device_put(results, devices, may_alias=True)
    except TypeError:  # a jax without may_alias (before 0.7): it copies
        return jax.device_put(results, devices)


class JaxAdapter:
    """jax.Array for the core ops (:class:`gradsync.arrays.dispatch.ArrayAdapter`): a read-only host view
    in, numpy buffers out (``gradsync.jax`` turns those into jax arrays)."""

    def info(self, x: Any) -> TensorInfo:
        check_concrete(x, "gradsync")
        if not isinstance(x, np.ndarray):
            single_device(x, "gradsync")
        # "cpu" even for an array on a GPU: what the core moves is its host copy (module docstring).
        return TensorInfo(dtypes.dtype_name(np.dtype(x.dtype)), tuple(x.shape), "cpu")

    def host_view(self, x: Any) -> np.ndarray:
        return host_view(x)

    def empty(self, like: Any, shape: tuple[int, ...]) -> np.ndarray:
        return aligned_empty(shape, np.dtype(like.dtype))

    def from_host(self, like: Any, array: np.ndarray) -> np.ndarray:
        return array

    def device_runtime(self, x: Any) -> None:
        return None  # device arrays are staged through host memory (docs/jax.md)


ADAPTER = JaxAdapter()
register("jax", ADAPTER)
register("jaxlib", ADAPTER)
