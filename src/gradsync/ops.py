"""The public collective operations, on numpy arrays, torch tensors, or any DLPack/array-API array.

Every op is negotiated by the coordinator: it runs only once every rank has submitted it, in the
same order on every rank, whatever order the ranks submitted in. ``*_async`` ops return a
:class:`~gradsync.handles.Handle` at once; the others block until the result is ready.

Names identify a collective across ranks: every rank must use the same name for the same
collective. Unnamed ops are named by kind and by how many unnamed ops of that kind this rank
issued before (on the same process set), so ranks must issue their unnamed ops in the same order.
The members of a grouped op named ``g`` are named ``g.0``, ``g.1``, ... in the order of the input
tensors.
"""

from __future__ import annotations

import contextlib
import contextvars
import pickle
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from . import adasum, dtypes, runtime
from .arrays import adapter_for
from .device import DeviceRuntime, device_kind
from .fusion import split_rows
from .handles import GroupHandle, Handle
from .process_sets import ProcessSet, global_process_set
from .protocol import Kind, ReduceOp, Request
from .queue import WAITING, Entry

if TYPE_CHECKING:  # imported by init() only (it imports mpi4py.MPI)
    from .coordinator import Coordinator

_SUPPORTED = ", ".join(dtypes.SUPPORTED)

#: True inside :func:`refusing_join`: the collectives submitted then carry ``refuse_join``.
_REFUSE_JOIN = contextvars.ContextVar("gradsync_refuse_join", default=False)


@contextlib.contextmanager
def refusing_join() -> Iterator[None]:
    """Collectives submitted inside fail on every rank (CollectiveError) while some rank has called
    :func:`join`, instead of running with the joined ranks' stand-ins: Horovod's semantics for
    allgather, broadcast, alltoall and reducescatter, used by the Horovod namespace
    (``gradsync.torch``). The decision is negotiated, so it is the same on every rank."""
    token = _REFUSE_JOIN.set(True)
    try:
        yield
    finally:
        _REFUSE_JOIN.reset(token)


def _prepare(tensor: Any, name: str | None, kind: Kind, process_set: ProcessSet,
             where: str | None = None):
    """Check ``tensor`` is something gradsync can move; return the process set's coordinator,
    adapter, info, the tensor's device runtime (None in host memory) and the label that names it in
    errors (``where``, if given). An unnamed op gets its name only once every check passed (_name),
    so a call rejected on one rank does not shift the names of that rank's later unnamed ops."""
    rt = runtime.get()
    if where is None:
        label = "(unnamed)" if name is None else repr(str(name))
        where = f"gradsync: rank {rt.rank}: {kind.name.lower()} of tensor {label}"
    coordinator = rt.coordinator_for(process_set, where)
    try:
        adapter = adapter_for(tensor, name)
        info = adapter.info(tensor)
    except TypeError as exc:  # name the rank too, as every error about a collective does
        raise TypeError(f"{where}: {str(exc).removeprefix('gradsync: ')}") from None
    if info.dtype not in dtypes.NUMPY_DTYPES:
        raise TypeError(f"{where}: dtype {info.dtype} is not supported (supported: {_SUPPORTED})")
    device = None
    if device_kind(info.device) != "cpu":
        device = adapter.device_runtime(tensor) if device_kind(info.device) == "cuda" else None
        if device is None:
            raise TypeError(f"{where}: the tensor is on {info.device}; gradsync moves host (CPU) "
                            "memory, torch CUDA tensors and CuPy arrays")
    return coordinator, adapter, info, device, where


def _output(adapter, tensor: Any, shape: tuple[int, ...], in_place: bool, where: str,
            device: DeviceRuntime | None = None):
    """The input's view, the result's view and the result: the tensor itself when in place (which
    must then be writable), else a new tensor of the same kind. Views are numpy views of host
    memory, or for device tensors ``device.view`` of them."""
    if device is not None:
        source = device.view(tensor)
        if in_place:
            return source, source, tensor
        result = adapter.empty(tensor, shape)
        return source, device.view(result), result
    source = adapter.host_view(tensor)
    if in_place:
        if not source.flags.writeable:
            raise ValueError(f"{where}: in-place operation on a read-only array; use the op without "
                             "the trailing underscore (allreduce, broadcast, ...), which returns a new "
                             "array (for jax arrays, which are immutable: gradsync.jax.allreduce, ...)")
        return source, source, tensor
    result = adapter.empty(tensor, shape)
    return source, adapter.host_view(result), result


def _entry(request: Request, source: Any, target: Any, result: Any, device: DeviceRuntime | None,
           allocate=None) -> Entry:
    """The coordinator's entry; for a device tensor it records the caller's current stream (where
    results are allocated) and, on it, the event after which the tensor's data is ready (the
    coordinator's stream waits for it)."""
    entry = Entry(request, Handle(request.name), source, target, result, allocate)
    if device is not None:
        entry.runtime = device
        entry.device = device.device_index(source)
        entry.stream = device.current_stream(entry.device)
        entry.ready = device.event(entry.device)
        device.record(entry.ready, entry.stream)
    return entry


class _Prepared(NamedTuple):
    """One tensor, checked and ready to queue: its process set's coordinator, its request (named
    when it is queued), the Entry's source, target and result, its device runtime (None in host
    memory) and the allocator of its result (allgather, alltoall)."""

    coordinator: Coordinator
    request: Request
    source: Any
    target: Any
    result: Any
    device: DeviceRuntime | None
    allocate: Callable[..., tuple[Any, Any]] | None = None

    def entry(self, name: str, group: str = "", group_size: int = 0) -> Entry:
        request = self.request.queued_as(name, group, group_size, _REFUSE_JOIN.get())
        return _entry(request, self.source, self.target, self.result, self.device, self.allocate)

    def submit(self, name: str | None, kind: str) -> Handle:
        """Queue it alone under ``name`` (None: an automatic name for ``kind``)."""
        return self.coordinator.submit(self.entry(_name(self.coordinator, name, kind)))


def _name(coordinator: Coordinator, name: str | None, kind: str) -> str:
    if name is not None:
        return str(name)
    return runtime.get().auto_name(kind, coordinator.process_set_id)


def _root(coordinator: Coordinator, root_rank: Any, where: str) -> int:
    """``root_rank`` (a world rank) as a rank of the coordinator's process set.

    Raises:
        ValueError: not an integer rank of the set (the message lists the set's ranks).
    """
    ranks = list(coordinator.world_ranks or range(coordinator.size))
    if isinstance(root_rank, (int, np.integer)) and not isinstance(root_rank, bool):
        if root_rank in ranks:
            return ranks.index(int(root_rank))
    if coordinator.world_ranks is None:
        raise ValueError(f"{where}: root_rank={root_rank!r} is not a rank of this job "
                         f"(0 .. {coordinator.size - 1})")
    raise ValueError(f"{where}: root_rank={root_rank!r} is not a member of process set "
                     f"{coordinator.process_set_id} (world ranks {coordinator.world_ranks})")


def _check_reduction(where: str, dtype: str, op: ReduceOp, prescale: float, postscale: float):
    if dtype == "bool" and op == ReduceOp.Average:
        raise TypeError(f"{where}: op=Average is not defined for bool tensors; use Sum (logical or) "
                        "or Min (logical and)")
    if dtype not in dtypes.FLOATING and (prescale != 1.0 or postscale != 1.0):
        raise TypeError(f"{where}: prescale_factor={prescale} / postscale_factor={postscale} need a "
                        f"floating-point tensor, but it is {dtype}")


def _check_not_scalar(shape: tuple[int, ...], where: str) -> None:
    """Allgather and alltoall concatenate and split along dimension 0, which a 0-d tensor lacks."""
    if len(shape) == 0:
        raise ValueError(f"{where}: needs at least one dimension, got a 0-d tensor (reshape it "
                         "to (1,))")


def _host_only(device: DeviceRuntime | None, kind: Kind, where: str) -> None:
    if device is not None:
        raise TypeError(f"{where}: {kind.name.lower()} of GPU tensors is not supported yet (allreduce, "
                        "grouped allreduce, broadcast and allgather are); copy the tensor to the host")


def _reduction(tensor: Any, name: str | None, kind: Kind, op: ReduceOp, prescale_factor: float,
               postscale_factor: float, in_place: bool, process_set: ProcessSet,
               where: str | None = None) -> _Prepared:
    """Check the input of an allreduce or reducescatter (one member of a group, given ``where``)."""
    coordinator, adapter, info, device, where = _prepare(tensor, name, kind, process_set, where)
    try:
        op = op if type(op) is ReduceOp else ReduceOp(op)
    except ValueError:
        raise ValueError(f"{where}: op={op!r} is not one of {[o.name for o in ReduceOp]}") from None
    if op == ReduceOp.Adasum:
        if kind != Kind.ALLREDUCE:
            raise NotImplementedError(f"{where}: op=Adasum is supported by allreduce and "
                                      "grouped_allreduce only")
        adasum.check(info.dtype, device is None, coordinator.size, where)
    prescale, postscale = float(prescale_factor), float(postscale_factor)
    _check_reduction(where, info.dtype, op, prescale, postscale)
    shape = info.shape
    if kind == Kind.REDUCESCATTER:
        _host_only(device, kind, where)
        if len(shape) == 0:
            raise ValueError(f"{where}: needs at least one dimension to scatter, got a 0-d tensor "
                             "(reshape it to (1,))")
        shape = (split_rows(shape[0], coordinator.size)[coordinator.rank],) + tuple(shape[1:])
    source, target, result = _output(adapter, tensor, shape, in_place, where, device)
    request = Request("", kind, coordinator.rank, info.dtype, info.shape, op, prescale=prescale,
                      postscale=postscale, device=device_kind(info.device))
    return _Prepared(coordinator, request, source, target, result, device)


def _allreduce(tensor: Any, name: str | None, op: ReduceOp, prescale_factor: float,
               postscale_factor: float, in_place: bool, process_set: ProcessSet,
               kind: Kind = Kind.ALLREDUCE) -> Handle:
    prepared = _reduction(tensor, name, kind, op, prescale_factor, postscale_factor, in_place,
                          process_set)
    return prepared.submit(name, kind.name.lower())


def _grouped_reduction(tensors: Sequence[Any], name: str | None, kind: Kind, op: ReduceOp,
                       prescale_factor: float, postscale_factor: float, in_place: bool,
                       process_set: ProcessSet) -> GroupHandle:
    return _grouped(tensors, name, kind, process_set, lambda tensor, where: _reduction(
        tensor, None, kind, op, prescale_factor, postscale_factor, in_place, process_set, where))


def _grouped(tensors: Sequence[Any], name: str | None, kind: Kind, process_set: ProcessSet,
             prepare: Callable[[Any, str], _Prepared]) -> GroupHandle:
    """Check every member (``prepare(tensor, where)``), then submit them all at once as one
    group (or none, on any error)."""
    rt = runtime.get()
    label = "(unnamed)" if name is None else repr(str(name))
    where = f"gradsync: rank {rt.rank}: grouped_{kind.name.lower()} {label}"
    coordinator = rt.coordinator_for(process_set, where)
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{where}: tensors must be a list or tuple of tensors, got a "
                        f"{type(tensors).__module__}.{type(tensors).__qualname__}")
    if not tensors:
        raise ValueError(f"{where}: the group is empty; pass at least one tensor")
    members = [prepare(t, f"{where}, member {i}") for i, t in enumerate(tensors)]
    for what, field in (("dtype", "dtype"), ("kind of memory", "device")):
        seen = [getattr(member.request, field) for member in members]
        if len(set(seen)) > 1:
            listed = ", ".join(f"member {i}: {v}" for i, v in enumerate(seen))
            raise TypeError(f"{where}: every member of a group must have the same {what} (they are "
                            f"fused into one buffer); got {listed}")
    group = _name(coordinator, name, f"grouped_{kind.name.lower()}")
    entries = [member.entry(f"{group}.{i}", group, len(members)) for i, member in enumerate(members)]
    return GroupHandle(group, coordinator.submit_group(entries))


def allreduce_async(tensor: Any, name: str | None = None, op: ReduceOp = ReduceOp.Average,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start an allreduce of ``tensor`` into a new tensor; same semantics as MPI_Allreduce.

    Args:
        tensor: any shape (zero-size and non-contiguous included) and a dtype of
            :data:`gradsync.dtypes.SUPPORTED`, in host memory or (a torch CUDA tensor, a CuPy array)
            on this rank's GPU; the same shape, dtype and kind of device on every rank. A device
            tensor is reduced on gradsync's CUDA stream: the handle completes when that work is
            enqueued, and synchronize() makes the caller's current stream wait for it
            (docs/gpu.md).
        name: identifies the collective across ranks (see the module docstring).
        op: ``Average`` (default; integer tensors: floor of the mean), ``Sum``, ``Min``, ``Max``,
            ``Product``. bool tensors: Sum/Max are logical or, Min/Product logical and.
            ``Adasum``: the adaptive sum of :mod:`gradsync.adasum` (floating-point host tensors,
            a power-of-two number of ranks).
        prescale_factor: multiplies the input before the reduction (floating dtypes only).
        postscale_factor: multiplies the result after it (floating dtypes only).
        process_set: the ranks that take part (default: every rank); Average divides by its size.

    Returns:
        A handle; :func:`synchronize` returns a new tensor of the same type, shape and dtype.
        float16/bfloat16 are reduced in float32 and rounded once.

    Raises:
        NotInitializedError: before ``init()``.
        TypeError: unsupported array type, dtype or device; Average of bool; scale factors on an
            integer tensor. The message names the tensor and the rank.
        NotImplementedError: ``op=Adasum`` on a number of ranks that is not a power of two.
        ValueError: unknown ``op``; a collective of that name still in flight on this rank;
            ``process_set`` not registered or this rank not a member of it; a device tensor on
            another GPU than this rank's earlier ones.
        CollectiveError (from synchronize): ranks disagreed on dtype, shape, op or factors; the
            message lists each rank's value.
    """
    return _allreduce(tensor, name, op, prescale_factor, postscale_factor, False, process_set)


def allreduce_async_(tensor: Any, name: str | None = None, op: ReduceOp = ReduceOp.Average,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """In-place form of :func:`allreduce_async`: the result is written into ``tensor`` itself.

    Do not read or write ``tensor`` until the handle completes. Same arguments and errors as
    :func:`allreduce_async`, plus ValueError for a read-only array.
    """
    return _allreduce(tensor, name, op, prescale_factor, postscale_factor, True, process_set)


def allreduce(tensor: Any, name: str | None = None, op: ReduceOp = ReduceOp.Average,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> Any:
    """Blocking :func:`allreduce_async`: returns the reduced tensor (a new one)."""
    return _now(process_set, allreduce_async, tensor, name, op, prescale_factor, postscale_factor,
                                       process_set)


def allreduce_(tensor: Any, name: str | None = None, op: ReduceOp = ReduceOp.Average,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> Any:
    """Blocking :func:`allreduce_async_`: reduces ``tensor`` in place and returns it."""
    return _now(process_set, allreduce_async_, tensor, name, op, prescale_factor, postscale_factor,
                                        process_set)


_GROUPED_DOC = """

    The members are negotiated as one unit: none runs before every rank has submitted the whole
    group, and then all of them run together, fused into one buffer whatever the fusion threshold.
    If the ranks disagree on any member (shape, dtype, op, number of members), every member fails
    on every rank with one CollectiveError naming the group, the member and each rank's value.
    """


def grouped_allreduce_async(tensors: Sequence[Any], name: str | None = None,
                            op: ReduceOp = ReduceOp.Average, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> GroupHandle:
    """Start an allreduce of every tensor of ``tensors`` as one group, each into a new tensor.

    Args:
        tensors: a non-empty list or tuple of tensors of one dtype (any shapes), each as for
            :func:`allreduce_async`; the same number, shapes and dtype on every rank.
        name: the group's name (members are ``name.0``, ``name.1``, ...).
        op: as :func:`allreduce_async`, for every member.
        prescale_factor: as :func:`allreduce_async`, for every member.
        postscale_factor: as :func:`allreduce_async`, for every member.
        process_set: the ranks that take part (default: every rank).

    Returns:
        A :class:`~gradsync.handles.GroupHandle`; :func:`synchronize` returns the list of reduced
        tensors, in the order of ``tensors``.

    Raises:
        TypeError: ``tensors`` is not a list or tuple; members of different dtypes; any member's
            TypeError of :func:`allreduce_async` (the message names the member's position).
        ValueError: an empty group; unknown ``op``; a member name still in flight.
        CollectiveError (from synchronize): the whole group failed, see below.
    """
    return _grouped_reduction(tensors, name, Kind.ALLREDUCE, op, prescale_factor, postscale_factor,
                              False, process_set)


def grouped_allreduce_async_(tensors: Sequence[Any], name: str | None = None,
                             op: ReduceOp = ReduceOp.Average, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> GroupHandle:
    """In-place :func:`grouped_allreduce_async`: each result is written into its input tensor.

    Same arguments and errors, plus ValueError for a read-only member.
    """
    return _grouped_reduction(tensors, name, Kind.ALLREDUCE, op, prescale_factor, postscale_factor,
                              True, process_set)


def grouped_allreduce(tensors: Sequence[Any], name: str | None = None,
                      op: ReduceOp = ReduceOp.Average, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[Any]:
    """Blocking :func:`grouped_allreduce_async`: returns the list of reduced (new) tensors."""
    return _now(process_set, grouped_allreduce_async, tensors, name, op, prescale_factor, postscale_factor,
                                               process_set)


def grouped_allreduce_(tensors: Sequence[Any], name: str | None = None,
                       op: ReduceOp = ReduceOp.Average, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[Any]:
    """Blocking :func:`grouped_allreduce_async_`: reduces every tensor in place, returns the list."""
    return _now(process_set, grouped_allreduce_async_, tensors, name, op, prescale_factor,
                postscale_factor, process_set)


def reducescatter_async(tensor: Any, name: str | None = None, op: ReduceOp = ReduceOp.Average,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                        process_set: ProcessSet = global_process_set) -> Handle:
    """Start a reducescatter: reduce ``tensor`` across ranks, and give each rank its rows of the result.

    Same semantics as MPI_Reduce_scatter along dimension 0. The N rows are split as evenly as
    possible in rank order: rank r gets ``N // size`` rows, plus one if ``r < N % size`` (the
    first ``N % size`` ranks get one extra row), i.e. rows ``sum(counts[:r])`` to
    ``sum(counts[:r+1])`` of the allreduce's result. Ranks may get zero rows (N < size).

    Args:
        tensor: at least one dimension; the same shape and dtype on every rank.
        name: identifies the collective across ranks, as for :func:`allreduce_async`.
        op: as :func:`allreduce_async`, with the same dtype rules (float16/bfloat16 reduced in
            float32 and rounded once; integer Average is the floor of the mean; bool Sum/Max are
            or, Min/Product and).
        prescale_factor: as :func:`allreduce_async`.
        postscale_factor: as :func:`allreduce_async`.
        process_set: the ranks that take part (default: every rank); the rows are split among
            its members in world-rank order (``size`` is the set's size, ``r`` the member's
            ``process_set.rank()``).

    Returns:
        A handle; :func:`synchronize` returns a new tensor of shape ``(counts[rank],) + shape[1:]``.

    Raises:
        ValueError: a 0-d tensor. NotImplementedError: ``op=Adasum``. Others as
            :func:`allreduce_async`.
    """
    return _allreduce(tensor, name, op, prescale_factor, postscale_factor, False, process_set,
                      Kind.REDUCESCATTER)


def reducescatter(tensor: Any, name: str | None = None, op: ReduceOp = ReduceOp.Average,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                  process_set: ProcessSet = global_process_set) -> Any:
    """Blocking :func:`reducescatter_async`: returns this rank's rows of the reduction."""
    return _now(process_set, reducescatter_async, tensor, name, op, prescale_factor, postscale_factor,
                                           process_set)


def grouped_reducescatter_async(tensors: Sequence[Any], name: str | None = None,
                                op: ReduceOp = ReduceOp.Average, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0,
                                process_set: ProcessSet = global_process_set) -> GroupHandle:
    """Start a reducescatter of every tensor of ``tensors`` as one group (one MPI_Reduce_scatter).

    Each member is split along its own dimension 0 as :func:`reducescatter_async` says.

    Returns:
        A :class:`~gradsync.handles.GroupHandle`; :func:`synchronize` returns the list of this
        rank's rows of each member, in the order of ``tensors``.

    Raises:
        TypeError: as :func:`grouped_allreduce_async`.
        ValueError: as :func:`grouped_allreduce_async`, and for a 0-d member.
        NotImplementedError: ``op=Adasum``.
    """
    return _grouped_reduction(tensors, name, Kind.REDUCESCATTER, op, prescale_factor,
                              postscale_factor, False, process_set)


def grouped_reducescatter(tensors: Sequence[Any], name: str | None = None,
                          op: ReduceOp = ReduceOp.Average, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0,
                          process_set: ProcessSet = global_process_set) -> list[Any]:
    """Blocking :func:`grouped_reducescatter_async`: returns the list of this rank's rows."""
    return _now(process_set, grouped_reducescatter_async, tensors, name, op, prescale_factor,
                                                   postscale_factor, process_set)


for _grouped_op in (grouped_allreduce_async, grouped_reducescatter_async):
    _grouped_op.__doc__ += _GROUPED_DOC


def _check_splits(splits: Any, rows: int, size: int, where: str) -> tuple[int, ...]:
    """``splits`` as a tuple of ``size`` non-negative ints summing to ``rows``; None: even split."""
    if splits is None:
        if rows % size:
            raise ValueError(f"{where}: dimension 0 ({rows}) is not divisible by the number of ranks "
                             f"({size}); pass splits= to say how many rows go to each rank")
        return (rows // size,) * size
    values = splits.tolist() if hasattr(splits, "tolist") else splits
    if not isinstance(values, (list, tuple)) or not all(
            isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) for v in values):
        raise TypeError(f"{where}: splits must be a sequence of {size} ints (one per rank), got "
                        f"{splits!r}")
    values = tuple(int(v) for v in values)
    if len(values) != size:
        raise ValueError(f"{where}: splits has {len(values)} entries but there are {size} ranks: "
                         f"{list(values)}")
    if any(v < 0 for v in values):
        raise ValueError(f"{where}: splits must not be negative: {list(values)}")
    if sum(values) != rows:
        raise ValueError(f"{where}: splits {list(values)} sum to {sum(values)}, but dimension 0 "
                         f"of the tensor is {rows}")
    return values


def alltoall_async(tensor: Any, splits: Any = None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> Handle:
    """Start an alltoall: send rows of ``tensor`` to every rank, receive every rank's rows for this one.

    Same semantics as MPI_Alltoallv along dimension 0: the first ``splits[0]`` rows go to rank 0,
    the next ``splits[1]`` to rank 1, and so on; the output holds the rows received from rank 0,
    then from rank 1, ... (a rank that called :func:`join` sends none).

    Args:
        tensor: at least one dimension; dimension 0 may differ between ranks, the others and the
            dtype must match.
        splits: rows for each destination rank: a sequence (or 1-d integer array) of ``size()``
            non-negative ints summing to ``tensor.shape[0]``; may differ between ranks and between
            calls. None: ``shape[0] / size()`` rows to every rank (which must divide evenly).
        name: identifies the collective across ranks (see the module docstring).
        process_set: the ranks that take part (default: every rank); ``size()`` and rank above
            then mean the set's size and this rank's position in it (``process_set.rank()``).

    Returns:
        A handle; :func:`synchronize` returns ``(output, received_splits)``: a new tensor of shape
        ``(sum(received_splits),) + shape[1:]``, and the rows received from each rank as a 1-d
        int64 array of the input's framework (numpy, torch, ...).

    Raises:
        ValueError: a 0-d tensor; splits of the wrong length, negative, or not summing to
            ``shape[0]``; ``shape[0]`` not divisible by ``size()`` when splits is None.
        TypeError: splits that are not integers. Others as :func:`allreduce_async`.
        CollectiveError (from synchronize): the ranks disagree on dtype or on the trailing shape.
    """
    coordinator, adapter, info, device, where = _prepare(tensor, name, Kind.ALLTOALL, process_set)
    _host_only(device, Kind.ALLTOALL, where)
    _check_not_scalar(info.shape, where)
    splits = _check_splits(splits, info.shape[0], coordinator.size, where)

    def allocate(shape: tuple[int, ...], received: list[int]) -> tuple[Any, np.ndarray]:
        output = adapter.empty(tensor, shape)
        received_splits = adapter.from_host(tensor, np.array(received, np.int64))
        return (output, received_splits), adapter.host_view(output)

    request = Request("", Kind.ALLTOALL, coordinator.rank, info.dtype, info.shape, splits=splits)
    return _Prepared(coordinator, request, adapter.host_view(tensor), None, None, None,
                     allocate).submit(name, "alltoall")


def alltoall(tensor: Any, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> tuple[Any, Any]:
    """Blocking :func:`alltoall_async`: returns ``(output, received_splits)``."""
    return _now(process_set, alltoall_async, tensor, splits, name, process_set)


def _broadcast(tensor: Any, root_rank: int, name: str | None, in_place: bool,
               process_set: ProcessSet) -> Handle:
    coordinator, adapter, info, device, where = _prepare(tensor, name, Kind.BROADCAST, process_set)
    root = _root(coordinator, root_rank, where)
    source, target, result = _output(adapter, tensor, info.shape, in_place, where, device)
    request = Request("", Kind.BROADCAST, coordinator.rank, info.dtype, info.shape, root=root,
                      device=device_kind(info.device))
    return _Prepared(coordinator, request, source, target, result, device).submit(name, "broadcast")


def broadcast_async(tensor: Any, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start a broadcast of ``root_rank``'s ``tensor`` into a new tensor on every rank.

    Same semantics as MPI_Bcast. ``tensor`` must have the same shape and dtype on every rank (its
    contents matter on the root only). ``root_rank`` is a world rank; with ``process_set`` it must
    be a member, and only the set's members take part.

    Raises:
        ValueError: ``root_rank`` outside 0 .. size()-1 or outside ``process_set`` (checked before
            anything is sent); ``process_set`` not registered or this rank not in it.
        TypeError, NotInitializedError, CollectiveError: as :func:`allreduce_async`.
    """
    return _broadcast(tensor, root_rank, name, False, process_set)


def broadcast_async_(tensor: Any, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """In-place :func:`broadcast_async`: ``tensor`` receives the root's values on every rank."""
    return _broadcast(tensor, root_rank, name, True, process_set)


def broadcast(tensor: Any, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> Any:
    """Blocking :func:`broadcast_async`: returns a new tensor holding the root's values."""
    return _now(process_set, broadcast_async, tensor, root_rank, name, process_set)


def broadcast_(tensor: Any, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> Any:
    """Blocking :func:`broadcast_async_`: overwrites ``tensor`` with the root's values, returns it."""
    return _now(process_set, broadcast_async_, tensor, root_rank, name, process_set)


def _gathered(tensor: Any, name: str | None, process_set: ProcessSet,
              where: str | None = None) -> _Prepared:
    """Check the input of an allgather (one member of a group, given ``where``)."""
    coordinator, adapter, info, device, where = _prepare(tensor, name, Kind.ALLGATHER, process_set,
                                                         where)
    _check_not_scalar(info.shape, where)
    view = adapter.host_view if device is None else device.view

    def allocate(shape: tuple[int, ...]) -> tuple[Any, Any]:
        result = adapter.empty(tensor, shape)
        return result, view(result)

    request = Request("", Kind.ALLGATHER, coordinator.rank, info.dtype, info.shape,
                      device=device_kind(info.device))
    return _Prepared(coordinator, request, view(tensor), None, None, device, allocate)


def allgather_async(tensor: Any, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start an allgather: the ranks' tensors concatenated along dimension 0, in rank order.

    Same semantics as MPI_Allgatherv. ``tensor`` must have at least one dimension; the first
    dimension may differ between ranks, the others and the dtype must match. With ``process_set``,
    only its members' tensors are gathered, in the order of their world ranks.

    Returns:
        A handle; :func:`synchronize` returns a new tensor of shape
        ``(sum of every rank's shape[0],) + shape[1:]``.

    Raises:
        ValueError: a 0-d tensor. Others as :func:`allreduce_async`.
    """
    return _gathered(tensor, name, process_set).submit(name, "allgather")


def allgather(tensor: Any, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> Any:
    """Blocking :func:`allgather_async`: returns the concatenated tensor."""
    return _now(process_set, allgather_async, tensor, name, process_set)


def grouped_allgather_async(tensors: Sequence[Any], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> GroupHandle:
    """Start an allgather of every tensor of ``tensors`` as one group; same semantics as
    :func:`allgather_async` for each member (as Horovod's ``grouped_allgather``).

    The members are negotiated as one unit: none runs before every rank has submitted the whole
    group; then all of them move together, packed into one buffer (one MPI_Allgatherv, or one
    group of NCCL broadcasts). If the ranks disagree on any member (dtype, trailing shape, number
    of members), every member fails on every rank with one CollectiveError naming the group.

    Args:
        tensors: a non-empty list or tuple of tensors of one dtype and one kind of memory, each
            with at least one dimension; per member, dimension 0 may differ between ranks, the
            others must match.
        name: the group's name (members are ``name.0``, ``name.1``, ...).
        process_set: the ranks that take part (default: every rank).

    Returns:
        A :class:`~gradsync.handles.GroupHandle`; :func:`synchronize` returns the list of gathered
        tensors, in the order of ``tensors``, each of shape ``(sum of every rank's shape[0],) +
        shape[1:]`` of that member.

    Raises:
        TypeError: ``tensors`` is not a list or tuple; members of different dtypes or kinds of
            memory; any member's TypeError of :func:`allgather_async` (naming its position).
        ValueError: an empty group; a 0-d member; a member name still in flight.
        CollectiveError (from synchronize): the whole group failed.
    """
    return _grouped(tensors, name, Kind.ALLGATHER, process_set,
                    lambda tensor, where: _gathered(tensor, None, process_set, where))


def grouped_allgather(tensors: Sequence[Any], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[Any]:
    """Blocking :func:`grouped_allgather_async`: returns the list of gathered tensors."""
    return _now(process_set, grouped_allgather_async, tensors, name, process_set)


def barrier(name: str | None = None, process_set: ProcessSet = global_process_set) -> None:
    """Block until every rank (of ``process_set``) has called barrier (same semantics as MPI_Barrier).

    Goes through the coordinator, so it is ordered with the collectives submitted before it.

    Raises:
        ValueError: ``process_set`` not registered or this rank not in it.
    """
    _control(Kind.BARRIER, name, process_set)


def _control(kind: Kind, name: str | None, process_set: ProcessSet) -> Any:
    """Submit a collective that moves no data (barrier, join) and wait for it."""
    rt = runtime.get()
    coordinator = rt.coordinator_for(process_set, f"gradsync: rank {rt.rank}: {kind.name.lower()}")
    name = _name(coordinator, name, kind.name.lower())
    request = Request(name, kind, coordinator.rank, "uint8", ())
    empty = np.empty(0, np.uint8)
    with coordinator.caller_turn():
        return synchronize(coordinator.submit(Entry(request, Handle(name), empty, empty, None)))


def join(process_set: ProcessSet = global_process_set) -> int:
    """Declare that this rank has no more data; block until every rank has joined.

    Until then this rank keeps taking part in the other ranks' collectives without submitting any:
    its contribution to an allreduce is the identity of the op (zeros for Sum and Average, so
    gradients of ranks that ran out of data count as zero), to an allgather no rows; it cannot be
    the root of a broadcast (that broadcast fails with CollectiveError). ``Average`` divides by the
    world size, as Horovod and DDP (``divide_by_initial_world_size=True``) do; set
    ``GRADSYNC_JOIN_DIVISOR=contributors`` to divide by the ranks that have not joined instead.
    Same semantics as ``horovod.torch.join()``; use it for uneven inputs (ranks with different
    numbers of batches). Every rank must call it, the same number of times.

    With ``process_set``, only its members join, and only its collectives see this rank as joined.

    Returns:
        The rank that joined last (the same on every rank; a world rank).

    Raises:
        NotInitializedError: before ``init()``. ShutdownError, StallError: gradsync stopped meanwhile.
        ValueError: ``process_set`` not registered or this rank not in it.
    """
    return _control(Kind.JOIN, None, process_set)


def broadcast_object(obj: Any = None, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Broadcast any picklable object from ``root_rank``; returns the root's object on every rank.

    The object is pickled on the root (arguments on other ranks are ignored), its size broadcast,
    then its bytes. Same errors as :func:`broadcast`; unpickling errors propagate.
    """
    rt = runtime.get()
    where = f"gradsync: rank {rt.rank}: broadcast_object"
    coordinator = rt.coordinator_for(process_set, where)
    _root(coordinator, root_rank, where)
    name = _name(coordinator, name, "broadcast_object")
    payload = np.frombuffer(pickle.dumps(obj), np.uint8) if rt.rank == root_rank else None
    length = np.array([0 if payload is None else payload.size], np.int64)
    broadcast_(length, root_rank, name=f"{name}.size", process_set=process_set)
    data = payload.copy() if payload is not None else np.empty(int(length[0]), np.uint8)
    broadcast_(data, root_rank, name=f"{name}.data", process_set=process_set)
    return obj if rt.rank == root_rank else pickle.loads(data.tobytes())


def allgather_object(obj: Any, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """Gather any picklable object from every rank (of ``process_set``); returns the list in rank
    order, on every rank. Same errors as :func:`allgather`."""
    rt = runtime.get()
    coordinator = rt.coordinator_for(process_set, f"gradsync: rank {rt.rank}: allgather_object")
    name = _name(coordinator, name, "allgather_object")
    payload = np.frombuffer(pickle.dumps(obj), np.uint8)
    sizes = allgather(np.array([payload.size], np.int64), name=f"{name}.size", process_set=process_set)
    data = allgather(payload.copy(), name=f"{name}.data", process_set=process_set)
    bounds = np.concatenate(([0], np.cumsum(sizes))).tolist()
    return [pickle.loads(data[a:b].tobytes()) for a, b in zip(bounds, bounds[1:])]


class blocking:  # noqa: N801 - used as a function, ``with blocking(process_set):``
    """Around a blocking op's submission and wait, as the caller's turn
    (:meth:`Coordinator.caller_turn`): with caller runs, this thread takes the coordinator before
    it submits, so that the push wakes no one and the cycle runs here. Framework adapters whose
    blocking ops are ``synchronize(*_async(...))`` (gradsync.torch's) submit inside it. Does
    nothing (the op waits as an asynchronous one) if gradsync is not initialised, this rank is not
    in ``process_set``, the background thread is busy, or caller runs is off; raises nothing of
    its own. A class rather than a generator: every blocking op enters one (docs/benchmarks.md,
    per-op cost)."""

    __slots__ = ("_process_set", "_coordinator", "_token")

    def __init__(self, process_set: ProcessSet = global_process_set) -> None:
        self._process_set = process_set
        self._coordinator: Coordinator | None = None

    def __enter__(self) -> None:
        try:
            coordinator = runtime.get().coordinator_for(self._process_set, "")
        except Exception:  # noqa: BLE001 - the op itself raises it again, with its own message
            coordinator = None
        self._token = WAITING.set(True)  # what this thread pushes, it waits for: no batching
        if coordinator is not None and coordinator.take_turn():
            self._coordinator = coordinator

    def __exit__(self, *exc_info: object) -> None:
        try:
            if self._coordinator is not None:
                self._coordinator, coordinator = None, self._coordinator
                coordinator.finish_turn()
        finally:
            WAITING.reset(self._token)


def _now(process_set: ProcessSet, start: Callable[..., Handle | GroupHandle], *args: Any) -> Any:
    """A blocking op: ``start(*args)`` (its ``*_async`` form) and wait for it, in :func:`blocking`.
    Errors are ``start``'s and :func:`synchronize`'s."""
    with blocking(process_set):
        return synchronize(start(*args))


def synchronize(handle: Handle | GroupHandle) -> Any:
    """Wait for ``handle`` and return its output tensor (the input itself for in-place ops); for a
    group, the list of outputs; for alltoall, the pair (output, received_splits).

    For device tensors it waits until the collective is enqueued on gradsync's CUDA stream and
    makes the caller's current stream wait for it; the host does not wait for the GPU.

    Raises the collective's error (CollectiveError, ShutdownError) if it failed.
    """
    return handle.wait()


def poll(handle: Handle | GroupHandle) -> bool:
    """True if ``handle``'s collective has finished (successfully or not); never blocks."""
    return handle.done()
