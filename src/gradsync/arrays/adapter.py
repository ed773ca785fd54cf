"""What gradsync needs to know about one framework's arrays: :class:`TensorInfo`, the
:class:`ArrayAdapter` protocol, and the table of adapters that framework modules register in.

A leaf module: it imports nothing of gradsync and no framework, so an adapter module
(``gradsync.torch.array``, ``gradsync.cupy``) imports it without importing the dispatcher of
:mod:`gradsync.arrays.dispatch`, which imports the adapter modules lazily, by name, on first sight of
their arrays (no import cycle).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol


class TensorInfo(NamedTuple):
    """What negotiation needs to know about a tensor: dtype name, shape and device string.
    Immutable named fields (a NamedTuple: one is built per op, cheaper than a frozen dataclass)."""

    dtype: str
    shape: tuple[int, ...]
    device: str


class ArrayAdapter(Protocol):
    """How gradsync reads, allocates and converts the arrays of one framework."""

    def info(self, x: Any) -> TensorInfo:
        """dtype name (see :mod:`gradsync.arrays.dtypes`), shape and device ('cpu', 'cuda:0', ...) of
        ``x``."""

    def host_view(self, x: Any) -> Any:
        """A writable numpy view sharing memory with ``x`` (which must be in host memory)."""

    def empty(self, like: Any, shape: tuple[int, ...]) -> Any:
        """A new uninitialised, C-contiguous array of ``shape`` with the dtype and device of ``like``."""

    def from_host(self, like: Any, array: Any) -> Any:
        """``array`` (a numpy array) as an array of ``like``'s framework, in host memory."""

    def cast(self, x: Any, dtype: str) -> Any:
        """``x`` converted to the dtype named ``dtype`` (a new array of the same framework and device)."""

    def device_runtime(self, x: Any) -> Any:
        """The :class:`gradsync.arrays.device.DeviceRuntime` of ``x``'s framework when ``x`` is in device
        memory; None for host arrays."""


_REGISTERED: dict[str, ArrayAdapter] = {}  # framework module name -> its adapter (filled on import)


def register(framework: str, adapter: ArrayAdapter) -> None:
    """Make ``adapter`` the one for arrays whose type lives in the top-level module ``framework``
    ('torch', 'cupy'); called once by the adapter module when it is imported."""
    _REGISTERED[framework] = adapter


def registered(framework: str) -> ArrayAdapter | None:
    """The adapter registered for ``framework``, or None."""
    return _REGISTERED.get(framework)
