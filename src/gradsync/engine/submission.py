"""Submission: a user's tensor checked and turned into a coordinator entry, and a blocking op's turn.

Every public op of :mod:`gradsync.ops` (and the framework adapters' ops built on them) goes
through here: :func:`prepare` checks the tensor (the process set, the array type, the dtype, the
device) and finds the process set's coordinator; :func:`prepare_reduction` and
:func:`prepare_gather` add what allreduce, reducescatter and allgather check (the op, the scale
factors, Adasum's requirements: :func:`gradsync.executors.adasum.check`); :class:`Prepared` queues the
checked tensor under its name (:func:`collective_name`: an unnamed op gets its name only once
every check passed), and :func:`submit_grouped` a whole group at once. :class:`blocking` is a
blocking op's turn at its coordinator (caller runs); :func:`refusing_join` marks what the Horovod
namespace submits as refusing a joined rank.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from ..arrays import dtypes
from ..arrays.device import DeviceRuntime, device_kind
from ..arrays.dispatch import adapter_for
from ..executors import adasum
from ..handles import GroupHandle, Handle
from ..process import runtime
from ..process_sets import ProcessSet, global_process_set
from .protocol import KIND_NAMES, Kind, ReduceOp, Request, split_rows
from .request_queue import WAITING, Entry

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


def prepare(tensor: Any, name: str | None, kind: Kind, process_set: ProcessSet,
             where: str | None = None):
    """Check ``tensor`` is something gradsync can move; return the process set's coordinator,
    adapter, info, the tensor's device runtime (None in host memory) and the label that names it in
    errors (``where``, if given). An unnamed op gets its name only once every check passed (_name),
    so a call rejected on one rank does not shift the names of that rank's later unnamed ops."""
    rt = runtime.get()
    if where is None:
        label = "(unnamed)" if name is None else repr(str(name))
        where = f"gradsync: rank {rt.rank}: {KIND_NAMES[kind]} of tensor {label}"
    coordinator = rt.coordinator_for(process_set, where)
    try:
        adapter = adapter_for(tensor, name)
        info = adapter.info(tensor)
    except TypeError as exc:  # name the rank too, as every error about a collective does
        raise TypeError(f"{where}: {str(exc).removeprefix('gradsync: ')}") from None
    if info.dtype not in dtypes.SUPPORTED:
        raise TypeError(f"{where}: dtype {info.dtype} is not supported (supported: {_SUPPORTED})")
    device = None
    if info.device != "cpu" and device_kind(info.device) != "cpu":
        device = adapter.device_runtime(tensor) if device_kind(info.device) == "cuda" else None
        if device is None:
            raise TypeError(f"{where}: the tensor is on {info.device}; gradsync moves host (CPU) "
                            "memory, torch CUDA tensors and CuPy arrays")
    return coordinator, adapter, info, device, where


def outputs(adapter, tensor: Any, shape: tuple[int, ...], in_place: bool, where: str,
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


class Prepared(NamedTuple):
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
        """The coordinator's entry under ``name`` (in ``group`` of ``group_size``, or none: ``""``,
        0); for a device tensor it records the caller's current stream (where results are
        allocated) and, on it, the event after which the tensor's data is ready (the
        coordinator's stream waits for it)."""
        request = self.request.queued_as(name, group, group_size, _REFUSE_JOIN.get())
        entry = Entry(request, Handle(name), self.source, self.target, self.result, self.allocate)
        device = self.device
        if device is not None:
            entry.runtime = device
            entry.device = device.device_index(self.source)
            entry.stream = device.current_stream(entry.device)
            entry.ready = device.event(entry.device)
            device.record(entry.ready, entry.stream)
        return entry

    def submit(self, name: str | None, kind: str) -> Handle:
        """Queue it alone under ``name`` (None: an automatic name for ``kind``)."""
        return self.coordinator.submit_group([self.entry(collective_name(self.coordinator, name, kind))])[0]


def collective_name(coordinator: Coordinator, name: str | None, kind: str) -> str:
    """``name`` as a string, or for None this rank's next automatic name for an op of ``kind`` on
    the coordinator's process set (``runtime.auto_name``: ranks must issue unnamed ops in the same
    order)."""
    if name is not None:
        return str(name)
    return runtime.get().auto_name(kind, coordinator.process_set_id)


def root_index(coordinator: Coordinator, root_rank: Any, where: str) -> int:
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


def reduction_is_identity(dtype_names: Sequence[str], op: Any, prescale: float, postscale: float,
                          process_set: ProcessSet) -> bool:
    """Whether an allreduce of tensors of ``dtype_names`` is the identity on this rank, so that an
    adapter may return its inputs (or, inside a compiled program, leave the program alone) instead
    of submitting it: ``process_set`` has one rank, this one, and no scale factor applies. Every
    op (Sum, Average, Min, Max, Product) of one rank is its input: the divisor of an Average is 1,
    an integer Average's floor of ``x / 1`` is ``x``. Any other case, a call the core would refuse
    included (an unsupported dtype, Average on bool, an unregistered set, a set without this
    rank, Adasum), is False: it goes to the core, which raises its usual error.

    The answer depends only on the set and the arguments, which every member of the set agrees
    on, so which collectives a rank submits stays the same on every rank (DESIGN.md).
    """
    try:
        op = ReduceOp(op)
    except ValueError:
        return False
    if (process_set.size() != 1 or op == ReduceOp.Adasum or float(prescale) != 1.0
            or float(postscale) != 1.0):
        return False
    try:
        runtime.get().coordinator_for(process_set, "")
        for name in dtype_names:
            if name not in dtypes.SUPPORTED:
                return False
            _check_reduction("", name, op, 1.0, 1.0)  # the core's rules (Average of bool)
    except (ValueError, TypeError):  # not registered, not a member, or refused: the core's error
        return False
    return True


def check_not_scalar(shape: tuple[int, ...], where: str) -> None:
    """Allgather and alltoall concatenate and split along dimension 0, which a 0-d tensor lacks."""
    if len(shape) == 0:
        raise ValueError(f"{where}: needs at least one dimension, got a 0-d tensor (reshape it "
                         "to (1,))")


def host_only(device: DeviceRuntime | None, kind: Kind, where: str) -> None:
    """Refuse a device tensor (``device`` set) for a collective of ``kind`` that gradsync runs in
    host memory only (alltoall, reducescatter).

    Raises:
        TypeError: naming the tensor by ``where``.
    """
    if device is not None:
        raise TypeError(f"{where}: {KIND_NAMES[kind]} of GPU tensors is not supported yet (allreduce, "
                        "grouped allreduce, broadcast and allgather are); copy the tensor to the host")


def prepare_reduction(tensor: Any, name: str | None, kind: Kind, op: ReduceOp, prescale_factor: float,
               postscale_factor: float, in_place: bool, process_set: ProcessSet,
               where: str | None = None) -> Prepared:
    """Check the input of an allreduce or reducescatter (one member of a group, given ``where``)."""
    coordinator, adapter, info, device, where = prepare(tensor, name, kind, process_set, where)
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
        host_only(device, kind, where)
        if len(shape) == 0:
            raise ValueError(f"{where}: needs at least one dimension to scatter, got a 0-d tensor "
                             "(reshape it to (1,))")
        shape = (split_rows(shape[0], coordinator.size)[coordinator.rank],) + tuple(shape[1:])
    source, target, result = outputs(adapter, tensor, shape, in_place, where, device)
    request = Request("", kind, coordinator.rank, info.dtype, info.shape, op, prescale=prescale,
                      postscale=postscale, device="cpu" if device is None else device_kind(info.device))
    return Prepared(coordinator, request, source, target, result, device)


def submit_grouped(tensors: Sequence[Any], name: str | None, kind: Kind, process_set: ProcessSet,
             prepare: Callable[[Any, str], Prepared]) -> GroupHandle:
    """Check every member (``prepare(tensor, where)``), then submit them all at once as one
    group (or none, on any error)."""
    rt = runtime.get()
    label = "(unnamed)" if name is None else repr(str(name))
    where = f"gradsync: rank {rt.rank}: grouped_{KIND_NAMES[kind]} {label}"
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
    group = collective_name(coordinator, name, f"grouped_{KIND_NAMES[kind]}")
    entries = [member.entry(f"{group}.{i}", group, len(members)) for i, member in enumerate(members)]
    return GroupHandle(group, coordinator.submit_group(entries))



def check_splits(splits: Any, rows: int, size: int, where: str) -> tuple[int, ...]:
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



def prepare_gather(tensor: Any, name: str | None, process_set: ProcessSet,
              where: str | None = None) -> Prepared:
    """Check the input of an allgather (one member of a group, given ``where``)."""
    coordinator, adapter, info, device, where = prepare(tensor, name, Kind.ALLGATHER, process_set,
                                                         where)
    check_not_scalar(info.shape, where)
    view = adapter.host_view if device is None else device.view

    def allocate(shape: tuple[int, ...]) -> tuple[Any, Any]:
        result = adapter.empty(tensor, shape)
        return result, view(result)

    request = Request("", Kind.ALLGATHER, coordinator.rank, info.dtype, info.shape,
                      device=device_kind(info.device))
    return Prepared(coordinator, request, view(tensor), None, None, device, allocate)



def submit_reduction(tensor: Any, name: str | None, op: ReduceOp, prescale_factor: float,
                     postscale_factor: float, in_place: bool, process_set: ProcessSet,
                     kind: Kind = Kind.ALLREDUCE) -> Handle:
    """Check and queue an allreduce (``kind``: or a reducescatter) of ``tensor``; its handle.
    Arguments and errors: :func:`gradsync.allreduce_async`."""
    prepared = prepare_reduction(tensor, name, kind, op, prescale_factor, postscale_factor,
                                 in_place, process_set)
    return prepared.submit(name, KIND_NAMES[kind])


def submit_grouped_reduction(tensors: Sequence[Any], name: str | None, kind: Kind, op: ReduceOp,
                             prescale_factor: float, postscale_factor: float, in_place: bool,
                             process_set: ProcessSet) -> GroupHandle:
    """Check and queue a grouped allreduce or reducescatter; its group handle. Arguments and
    errors: :func:`gradsync.grouped_allreduce_async`."""
    return submit_grouped(tensors, name, kind, process_set, lambda tensor, where: prepare_reduction(
        tensor, None, kind, op, prescale_factor, postscale_factor, in_place, process_set, where))


def run_control(kind: Kind, name: str | None, process_set: ProcessSet) -> Any:
    """Submit a collective that moves no data (barrier, join) and wait for it."""
    rt = runtime.get()
    coordinator = rt.coordinator_for(process_set, f"gradsync: rank {rt.rank}: {KIND_NAMES[kind]}")
    name = collective_name(coordinator, name, KIND_NAMES[kind])
    request = Request(name, kind, coordinator.rank, "uint8", ())
    empty = np.empty(0, np.uint8)
    with coordinator.turns.caller_turn():
        return coordinator.submit(Entry(request, Handle(name), empty, empty, None)).wait()


def run_blocking(process_set: ProcessSet, start: Callable[..., Handle | GroupHandle], *args: Any) -> Any:
    """A blocking op: ``start(*args)`` (its ``*_async`` form) and wait for it, in :func:`blocking`.
    Errors are ``start``'s and :meth:`gradsync.Handle.wait`'s."""
    with blocking(process_set):
        return start(*args).wait()


class blocking:  # noqa: N801 - used as a function, ``with blocking(process_set):``
    """Around a blocking op's submission and wait, as the caller's turn
    (:meth:`gradsync.engine.caller_runs.CallerRuns.caller_turn`): with caller runs, this thread takes the
    coordinator before it submits, so that the push wakes no one and the cycle runs here. Framework
    adapters whose blocking ops are ``synchronize(*_async(...))`` (gradsync.torch's) submit inside
    it. Does nothing (the op waits as an asynchronous one) if gradsync is not initialised, this rank
    is not in ``process_set``, the background thread is busy, or caller runs is off; raises nothing
    of its own. A class rather than a generator: every blocking op enters one (docs/benchmarks.md,
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
        if coordinator is not None and coordinator.turns.take_turn():
            self._coordinator = coordinator

    def __exit__(self, *exc_info: object) -> None:
        try:
            if self._coordinator is not None:
                self._coordinator, coordinator = None, self._coordinator
                coordinator.turns.finish_turn()
        finally:
            WAITING.reset(self._token)
