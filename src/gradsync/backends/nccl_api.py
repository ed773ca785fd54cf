"""The NCCL binding: libnccl.so.2 through cffi in ABI mode (no compiler, no CUDA headers at install time).

The declarations are ``nccl_api.h`` beside this module (a link to ``native/nccl_api.h`` in a source
checkout). This module is framework-agnostic: device buffers and CUDA streams are plain integers
(pointers) that the caller takes from its framework (``tensor.data_ptr()``,
``torch.cuda.current_stream().cuda_stream``, ``cupy_array.data.ptr``, ...).

Where the library is looked for, in order (the first that loads wins):

1. ``GRADSYNC_NCCL_LIBRARY``: the path of libnccl.so.2 (or of its directory). When set, it is the only
   place looked at: a wrong path is an error, never a silent fall-back to another NCCL.
2. a libnccl.so.2 this process has already loaded: a CUDA build of torch loads the NCCL it was
   built with (the ``nvidia-nccl-cu13`` wheel for CUDA 13) at ``import torch``. Taking that one keeps
   a second, possibly incompatible NCCL out of the process.
3. the ``nvidia-nccl-cu12`` wheel (``pip install gradsync[nccl-cu12]``),
4. the ``nvidia-nccl-cu13`` wheel (``pip install gradsync[nccl-cu13]``),
5. the system: ``ctypes.util.find_library("nccl")``, then ``libnccl.so.2`` through the dynamic loader
   (``LD_LIBRARY_PATH``, ld.so.cache).

The library is loaded once per process, on first use (:func:`load_library`), and the ``gradsync``
logger says at INFO level which one was taken; it loads and answers :func:`version` and
:func:`unique_id` without a GPU. Creating a communicator needs a CUDA device.
"""

from __future__ import annotations

import contextlib
import logging
import operator
from collections.abc import Iterator
from types import MappingProxyType
from typing import Any

from ..arrays import dtypes
from ..engine.protocol import LOGICAL_OPS, ReduceOp
from ..errors import NcclError, NcclUnavailableError
from .nccl_loader import (  # noqa: F401 - the binding's public names, and tests' helpers
    ENV_LIBRARY,
    LIBRARY_NAME,
    LOADED_PATTERN,
    LOADED_SOURCE,
    WHEELS,
    Library,
    _const,
    _dotted,
    _ffi,
    _search,
    decode_version,
    load_library,
    nccl_built,
    nccl_version,
    version,
)

log = logging.getLogger("gradsync")

__all__ = [
    "ENV_LIBRARY", "Library", "load_library", "version", "decode_version", "unique_id",
    "Communicator", "group", "check", "nccl_dtype", "nccl_op", "averages", "nccl_built", "nccl_version",
    "NcclError", "NcclUnavailableError",
]

UNIQUE_ID_BYTES = 128
#: ncclRemoteError: a peer exited or its network failed.
REMOTE_ERROR = 6

#: NCCL version that added ncclAvg and ncclBfloat16.
_AVG_AND_BF16 = (2, 10, 0)

_DTYPES = MappingProxyType({
    "float16": "ncclFloat16",
    "bfloat16": "ncclBfloat16",
    "float32": "ncclFloat32",
    "float64": "ncclFloat64",
    "int8": "ncclInt8",
    "uint8": "ncclUint8",
    "int32": "ncclInt32",
    "int64": "ncclInt64",
    "uint32": "ncclUint32",
    "uint64": "ncclUint64",
    # 0/1 bytes; only max (logical or) and min (logical and) are meaningful, see nccl_op().
    "bool": "ncclUint8",
})
_OPS = MappingProxyType({
    ReduceOp.Sum: "ncclSum",
    ReduceOp.Product: "ncclProd",
    ReduceOp.Min: "ncclMin",
    ReduceOp.Max: "ncclMax",
})




# ---------------------------------------------------------------------------------------------------
# Errors


def _text(ffi: Any, pointer: Any) -> str:
    return ffi.string(pointer).decode(errors="replace") if pointer != ffi.NULL else ""


def _last_error(library: Library, comm: Any = None) -> str:
    try:
        get_last_error = library.lib.ncclGetLastError  # NCCL >= 2.13
    except AttributeError:
        return ""
    return _text(library.ffi, get_last_error(library.ffi.NULL if comm is None else comm))


def check(result: int, what: str, comm: Any = None) -> None:
    """Raise :class:`NcclError` unless ``result`` (an ``ncclResult_t``) is ncclSuccess.

    ``what`` names the call (``"ncclAllReduce"``, or with its arguments: ``"ncclCommInitRank(nranks=2,
    rank=1)"``); the message adds NCCL's error string and, when the library has one, its last error
    text (``ncclGetLastError``, for ``comm`` when given). The error's ``call`` is the function name.
    """
    if result == 0:
        return
    library = load_library()
    message = f"{what} failed: {_text(library.ffi, library.lib.ncclGetErrorString(result))} " \
              f"(ncclResult_t {result})"
    last = _last_error(library, comm)
    if last:
        message += f"; last NCCL error: {last}"
    raise NcclError(message, result=result, call=what.partition("(")[0])


# ---------------------------------------------------------------------------------------------------
# dtypes and reduction operations


def nccl_dtype(dtype: str, nccl: tuple[int, int, int] | None = None) -> int:
    """The ``ncclDataType_t`` of a gradsync dtype name, for NCCL version ``nccl`` (default: the loaded one).

    bool travels as uint8 (0/1; reduce it only with the ops :func:`nccl_op` picks for bool).

    Raises:
        TypeError: int16 (NCCL has no 16-bit integer type), bfloat16 before NCCL 2.10, or an unknown name.
    """
    if dtype == "int16":
        raise TypeError("NCCL has no 16-bit integer type: int16 tensors cannot be reduced with NCCL; "
                        "convert them to int32 (or reduce them on the host with MPI)")
    if dtype not in _DTYPES:
        raise TypeError(f"NCCL does not support dtype {dtype!r}; supported: {', '.join(_DTYPES)}")
    if dtype == "bfloat16" and (nccl or version()) < _AVG_AND_BF16:
        raise TypeError(f"bfloat16 needs NCCL >= 2.10; this NCCL is {_dotted(nccl or version())}")
    return _const(_DTYPES[dtype])


def averages(dtype: str, nccl: tuple[int, int, int] | None = None) -> bool:
    """Whether NCCL (version ``nccl``, default: the loaded one) averages ``dtype`` itself: ncclAvg,
    floating-point dtypes from NCCL 2.10 on. It divides by the communicator's size."""
    return dtype in dtypes.FLOATING and (nccl or version()) >= _AVG_AND_BF16


def nccl_op(op: ReduceOp, dtype: str, nccl: tuple[int, int, int] | None = None) -> int:
    """The ``ncclRedOp_t`` for ``op`` on ``dtype`` tensors, for NCCL version ``nccl``.

    ``Average`` is ncclAvg, where NCCL has it for ``dtype`` (:func:`averages`); elsewhere reduce
    with Sum and divide (gradsync's fusion plan does: its integer Average is the floor of the exact
    mean, which ncclAvg, truncating in the tensor's own dtype, would not give).
    bool: Sum and Max are logical or (ncclMax on 0/1), Min and Product logical and (ncclMin).

    Raises:
        TypeError: Average of bool, Average that this NCCL does not compute for ``dtype``, or an
            unsupported dtype (see :func:`nccl_dtype`).
    """
    op = ReduceOp(op)
    nccl_dtype(dtype, nccl)
    if dtype == "bool":
        if op == ReduceOp.Average:
            raise TypeError("op=Average is not defined for bool tensors; use Sum (logical or) or "
                            "Min (logical and)")
        return _const(_OPS[LOGICAL_OPS[op]])  # bool: logical or (max), logical and (min)
    if op == ReduceOp.Average:
        if averages(dtype, nccl):
            return _const("ncclAvg")
        raise TypeError(f"NCCL {_dotted(nccl or version())} has no average for {dtype}: reduce with "
                        "Sum and divide the result")
    return _const(_OPS[op])


# ---------------------------------------------------------------------------------------------------
# Communicators


def unique_id() -> bytes:
    """A new NCCL unique id (128 bytes): created on one rank, sent to the others (e.g. by MPI
    broadcast), passed to :meth:`Communicator.init_rank` on every rank. Needs no GPU; it opens a
    bootstrap listening socket (choose its interface with NCCL_SOCKET_IFNAME)."""
    library = load_library()
    uid = library.ffi.new("ncclUniqueId *")
    check(library.lib.ncclGetUniqueId(uid), "ncclGetUniqueId")
    return bytes(library.ffi.buffer(uid))


@contextlib.contextmanager
def group() -> Iterator[None]:
    """``ncclGroupStart()`` ... ``ncclGroupEnd()`` around the body: NCCL calls inside it are launched
    together (needed for send/recv pairs and for several communicators driven by one thread).

    If the body raises, the group is still ended (NCCL needs balanced calls) and the body's exception
    propagates; otherwise an error of ncclGroupEnd raises :class:`NcclError`.
    """
    library = load_library()
    check(library.lib.ncclGroupStart(), "ncclGroupStart")
    try:
        yield
    except BaseException:
        library.lib.ncclGroupEnd()
        raise
    check(library.lib.ncclGroupEnd(), "ncclGroupEnd")


class Communicator:
    """One NCCL communicator (a rank's member of an NCCL clique), created by :meth:`init_rank`.

    Collectives are enqueued on the CUDA ``stream`` given (an integer ``cudaStream_t``; 0 is the
    default stream) and return before the data has moved: the caller orders them with its own CUDA
    events. Buffers are device pointers (integers) and counts are in elements of ``dtype`` (a gradsync
    dtype name). Call :meth:`destroy` (or :meth:`abort`, or use ``with``) when done; it is not done
    by garbage collection, since destroying a communicator is a call every rank must make.
    """

    def __init__(self, handle: Any, library: Library):
        self._handle = handle
        self._library = library

    @classmethod
    def init_rank(cls, nranks: int, unique_id: bytes, rank: int) -> Communicator:
        """``ncclCommInitRank``: join the clique of ``nranks`` identified by ``unique_id`` as ``rank``.

        Uses the current CUDA device (set it before, e.g. ``torch.cuda.set_device(local_rank)``) and
        blocks until all ``nranks`` ranks have called it.

        Raises:
            ValueError: a unique id that is not 128 bytes, or a rank outside ``[0, nranks)``.
            NcclError: NCCL refused (no GPU: "unhandled cuda error").
        """
        unique_id = bytes(unique_id)
        if len(unique_id) != UNIQUE_ID_BYTES:
            raise ValueError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got {len(unique_id)}")
        if not 0 <= rank < nranks:
            raise ValueError(f"rank {rank} is outside [0, {nranks})")
        library = load_library()
        ffi = library.ffi
        uid = ffi.new("ncclUniqueId *")
        ffi.memmove(uid, unique_id, UNIQUE_ID_BYTES)
        out = ffi.new("ncclComm_t *")
        check(library.lib.ncclCommInitRank(out, nranks, uid[0], rank),
              f"ncclCommInitRank(nranks={nranks}, rank={rank})")
        return cls(out[0], library)

    # -- state ---------------------------------------------------------------------------------

    def _live(self, what: str) -> Any:
        if self._handle is None:
            raise NcclError(f"{what}: this NCCL communicator was already destroyed or aborted", call=what)
        return self._handle

    def _check(self, result: int, what: str) -> None:
        check(result, what, self._handle)

    def _int(self, function: str, what: str) -> int:
        out = self._library.ffi.new("int *")
        self._check(getattr(self._library.lib, function)(self._live(what), out), function)
        return out[0]

    @property
    def size(self) -> int:
        """Number of ranks in the clique (ncclCommCount)."""
        return self._int("ncclCommCount", "size")

    @property
    def rank(self) -> int:
        """This member's rank (ncclCommUserRank)."""
        return self._int("ncclCommUserRank", "rank")

    @property
    def device(self) -> int:
        """The CUDA device of this communicator (ncclCommCuDevice)."""
        return self._int("ncclCommCuDevice", "device")

    def async_error(self) -> str | None:
        """None while the communicator is healthy, else NCCL's text of its asynchronous error
        (ncclCommGetAsyncError), e.g. a peer that failed; then :meth:`abort` it."""
        result = self._library.ffi.new("ncclResult_t *")
        self._check(self._library.lib.ncclCommGetAsyncError(self._live("async_error"), result),
                    "ncclCommGetAsyncError")
        if result[0] == 0:
            return None
        text = _text(self._library.ffi, self._library.lib.ncclGetErrorString(result[0]))
        last = _last_error(self._library, self._handle)
        return f"{text} (ncclResult_t {result[0]})" + (f"; last NCCL error: {last}" if last else "")

    def destroy(self) -> None:
        """ncclCommDestroy: wait for pending operations and free the communicator. Idempotent."""
        if self._handle is not None:
            handle, self._handle = self._handle, None
            check(self._library.lib.ncclCommDestroy(handle), "ncclCommDestroy")

    def abort(self) -> None:
        """ncclCommAbort: free the communicator without waiting (after an error). Idempotent."""
        if self._handle is not None:
            handle, self._handle = self._handle, None
            check(self._library.lib.ncclCommAbort(handle), "ncclCommAbort")

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            self.destroy()
        else:
            self.abort()

    # -- data movement -------------------------------------------------------------------------

    def _args(self, what: str, pointers: tuple[int, ...], count: int, dtype: str, stream: int):
        ffi = self._library.ffi
        if operator.index(count) < 0:
            raise ValueError(f"{what}: count must not be negative, got {count}")
        return ([ffi.cast("void *", operator.index(p)) for p in pointers], count,
                nccl_dtype(dtype, self._library.version), self._live(what),
                ffi.cast("cudaStream_t", operator.index(stream)))

    def allreduce(self, sendptr: int, recvptr: int, count: int, dtype: str, op: ReduceOp,
                  stream: int) -> None:
        """ncclAllReduce of ``count`` elements (in place when ``sendptr == recvptr``); ``op`` as
        :func:`nccl_op` maps it (Average only where NCCL averages ``dtype``)."""
        red_op = nccl_op(op, dtype, self._library.version)
        (send, recv), count, datatype, comm, cuda_stream = self._args(
            "ncclAllReduce", (sendptr, recvptr), count, dtype, stream)
        self._check(self._library.lib.ncclAllReduce(send, recv, count, datatype, red_op, comm, cuda_stream),
                    "ncclAllReduce")

    def broadcast(self, sendptr: int, recvptr: int, count: int, dtype: str, root: int, stream: int) -> None:
        """ncclBroadcast of ``count`` elements from ``root``'s ``sendptr`` into every ``recvptr``."""
        (send, recv), count, datatype, comm, cuda_stream = self._args(
            "ncclBroadcast", (sendptr, recvptr), count, dtype, stream)
        self._check(self._library.lib.ncclBroadcast(send, recv, count, datatype, root, comm, cuda_stream),
                    "ncclBroadcast")

    def allgather(self, sendptr: int, recvptr: int, sendcount: int, dtype: str, stream: int) -> None:
        """ncclAllGather: ``sendcount`` elements from each rank into ``recvptr`` (size x sendcount),
        in rank order."""
        (send, recv), count, datatype, comm, cuda_stream = self._args(
            "ncclAllGather", (sendptr, recvptr), sendcount, dtype, stream)
        self._check(self._library.lib.ncclAllGather(send, recv, count, datatype, comm, cuda_stream),
                    "ncclAllGather")

    def reducescatter(self, sendptr: int, recvptr: int, recvcount: int, dtype: str, op: ReduceOp,
                      stream: int) -> None:
        """ncclReduceScatter: reduce ``sendptr`` (size x recvcount) and leave block ``rank`` in
        ``recvptr``; ``op`` as :meth:`allreduce`."""
        red_op = nccl_op(op, dtype, self._library.version)
        (send, recv), count, datatype, comm, cuda_stream = self._args(
            "ncclReduceScatter", (sendptr, recvptr), recvcount, dtype, stream)
        self._check(self._library.lib.ncclReduceScatter(send, recv, count, datatype, red_op, comm,
                                                        cuda_stream), "ncclReduceScatter")

    def send(self, sendptr: int, count: int, dtype: str, peer: int, stream: int) -> None:
        """ncclSend of ``count`` elements to ``peer`` (pair it with the peer's recv, inside :func:`group`
        when a rank both sends and receives)."""
        (send,), count, datatype, comm, cuda_stream = self._args("ncclSend", (sendptr,), count, dtype, stream)
        self._check(self._library.lib.ncclSend(send, count, datatype, peer, comm, cuda_stream), "ncclSend")

    def recv(self, recvptr: int, count: int, dtype: str, peer: int, stream: int) -> None:
        """ncclRecv of ``count`` elements from ``peer``."""
        (recv,), count, datatype, comm, cuda_stream = self._args("ncclRecv", (recvptr,), count, dtype, stream)
        self._check(self._library.lib.ncclRecv(recv, count, datatype, peer, comm, cuda_stream), "ncclRecv")
