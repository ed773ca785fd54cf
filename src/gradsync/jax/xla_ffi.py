"""The in-place XLA custom call through which a reduction leaves a jitted program: jax's FFI with
a handler written in Python (ctypes), so nothing is compiled when gradsync is installed.

Why not ``io_callback``: a callback's results are new host arrays that XLA then copies into its
own output buffers, and its arguments arrive as further copies (one 7.4 MB gradient pytree cost
~5 ms a step in copies, docs/jax.md#performance). A custom call instead receives the addresses of
XLA's own buffers. :func:`call` declares each output aliased to its input
(``input_output_aliases``), so the handler finds the operand's values in the output buffer and the
core reduces them there, in place: MPI reads and writes XLA's memory, with no copy at all.

The handler (:func:`_handler`) is an ``XLA_FFI_Handler`` (xla/ffi/api/c_api.h, shipped in jaxlib):
it answers XLA's metadata query (the FFI API version), ignores the instantiate, prepare and
initialize stages, and at execution looks up the Python function that :func:`call` registered
under the call's ``key`` attribute and gives it writable numpy views of the output buffers. An
exception becomes an ``XLA_FFI_Error`` whose message XLA raises from the jitted call.

The call is not declared side-effecting: a side effect costs every call of the jitted function
jax's Python dispatch instead of its C++ fast path (~150 us a step with 14 arguments here,
docs/jax.md#performance). Declared pure, a call whose results are unused is dropped, and XLA may
order independent calls as its scheduler likes; both are decided by the compiler from the program
alone, so every rank that runs the same program drops and orders its calls the same way.
"""

from __future__ import annotations

import ctypes
import itertools
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

TARGET = "gradsync_inplace"  #: the name of the custom call target registered with XLA
_EXECUTE = 3  # XLA_FFI_ExecutionStage_EXECUTE
_METADATA = 1  # XLA_FFI_Extension_Metadata
_ERROR_INTERNAL = 13  # XLA_FFI_Error_Code_INTERNAL


class _Extension(ctypes.Structure):
    pass


_Extension._fields_ = [("struct_size", ctypes.c_size_t), ("type", ctypes.c_int),
                       ("next", ctypes.POINTER(_Extension))]


class _Version(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("major", ctypes.c_int), ("minor", ctypes.c_int)]


class _Metadata(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("api_version", _Version),
                ("traits", ctypes.c_uint32), ("state_type_id", ctypes.c_int64)]


class _MetadataExtension(ctypes.Structure):
    _fields_ = [("base", _Extension), ("metadata", ctypes.POINTER(_Metadata))]


class _Buffer(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("dtype", ctypes.c_int), ("data", ctypes.c_void_p), ("rank", ctypes.c_int64),
                ("dims", ctypes.POINTER(ctypes.c_int64))]


class _List(ctypes.Structure):
    """XLA_FFI_Args and XLA_FFI_Rets (the same layout); for XLA_FFI_Attrs ``names`` sits between."""

    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("size", ctypes.c_int64), ("types", ctypes.POINTER(ctypes.c_int)),
                ("items", ctypes.POINTER(ctypes.c_void_p))]


class _ByteSpan(ctypes.Structure):
    _fields_ = [("ptr", ctypes.c_char_p), ("len", ctypes.c_size_t)]


class _Attrs(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("size", ctypes.c_int64), ("types", ctypes.POINTER(ctypes.c_int)),
                ("names", ctypes.POINTER(ctypes.POINTER(_ByteSpan))),
                ("items", ctypes.POINTER(ctypes.c_void_p))]


class _Scalar(ctypes.Structure):
    _fields_ = [("dtype", ctypes.c_int), ("value", ctypes.POINTER(ctypes.c_int64))]


class _CallFrame(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.POINTER(_Extension)),
                ("api", ctypes.c_void_p), ("ctx", ctypes.c_void_p), ("stage", ctypes.c_int),
                ("args", _List), ("rets", _List), ("attrs", _Attrs), ("future", ctypes.c_void_p)]


class _ErrorArgs(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("message", ctypes.c_char_p), ("errc", ctypes.c_int)]


class _Api(ctypes.Structure):
    """The head of XLA_FFI_Api: its version and the first function pointer, XLA_FFI_Error_Create."""

    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("api_version", _Version), ("internal_api", ctypes.c_void_p),
                ("error_create", ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(_ErrorArgs)))]


Body = Callable[[list[np.ndarray]], None]  #: writes the results into the output views it is given

_bodies: dict[int, tuple[Body, tuple[jax.ShapeDtypeStruct, ...]]] = {}
_keys = itertools.count()
_lock = threading.Lock()
_registered: list[Any] = []  # the ctypes function, kept alive while XLA may call it


def _view(address: int, like: jax.ShapeDtypeStruct) -> np.ndarray:
    """A writable numpy array of ``like``'s shape and dtype over XLA's buffer at ``address``."""
    dtype = np.dtype(like.dtype)
    count = math.prod(like.shape)
    if count == 0:
        return np.empty(like.shape, dtype)
    raw = (ctypes.c_char * (count * dtype.itemsize)).from_address(address)
    return np.frombuffer(raw, dtype).reshape(like.shape)


def _key(frame: _CallFrame) -> int:
    """The call's ``key`` attribute (its only one, an int64 scalar)."""
    scalar = ctypes.cast(frame.attrs.items[0], ctypes.POINTER(_Scalar)).contents
    return scalar.value[0]


def _error(frame: _CallFrame, message: str) -> int:
    api = ctypes.cast(frame.api, ctypes.POINTER(_Api)).contents
    args = _ErrorArgs(ctypes.sizeof(_ErrorArgs), None, message.encode("utf-8", "replace"),
                      _ERROR_INTERNAL)
    return api.error_create(ctypes.byref(args))


def _handler(pointer: Any) -> int | None:
    """The XLA_FFI_Handler (module docstring). Returns NULL (None) or an XLA_FFI_Error*."""
    frame = pointer.contents
    extension = frame.extension_start
    if extension:
        if extension.contents.type == _METADATA:
            metadata = ctypes.cast(extension, ctypes.POINTER(_MetadataExtension)).contents.metadata
            api = ctypes.cast(frame.api, ctypes.POINTER(_Api)).contents
            metadata.contents.api_version.major = api.api_version.major
            metadata.contents.api_version.minor = api.api_version.minor
            metadata.contents.traits = 0
        return None
    if frame.stage != _EXECUTE:
        return None
    try:
        body, outputs = _bodies[_key(frame)]
        buffers = [ctypes.cast(frame.rets.items[i], ctypes.POINTER(_Buffer)).contents.data or 0
                   for i in range(frame.rets.size)]
        body([_view(address, like) for address, like in zip(buffers, outputs)])
    except BaseException as exc:  # noqa: BLE001 (an exception must not unwind through XLA's C++)
        return _error(frame, f"{type(exc).__name__}: {exc}")
    return None


_HANDLER_TYPE = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(_CallFrame))


def _register() -> None:
    with _lock:
        if _registered:
            return
        function = _HANDLER_TYPE(_handler)
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(function), platform="cpu")
        _registered.append(function)


def call(body: Body, operands: Sequence[jax.Array],
         extra: Sequence[jax.ShapeDtypeStruct] = ()) -> list[jax.Array]:
    """Run ``body`` on the values of ``operands`` in place, from inside a traced function.

    Args:
        body: called once per execution of the compiled call, on an XLA thread, with writable
            numpy views of the outputs: first one per operand (same shape and dtype), which hold
            the operands' values, then one per ``extra`` (uninitialised); it writes its results
            into them.
        operands: traced (or concrete) CPU arrays; each gets its own output buffer, aliased to it.
        extra: shapes and dtypes of further outputs, not aliased to any operand.

    Returns:
        The outputs, as traced arrays: the operands' shapes and dtypes, then ``extra``'s.

    Raises:
        (at run time, from the jitted call) jax's runtime error carrying the type and message of
        what ``body`` raised.
    """
    _register()
    outputs = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in operands) + tuple(extra)
    key = next(_keys)
    _bodies[key] = (body, outputs)
    run = jax.ffi.ffi_call(TARGET, outputs, has_side_effect=False,
                           input_output_aliases={i: i for i in range(len(operands))})
    return list(run(*operands, key=np.int64(key)))
