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

import pickle
from collections.abc import Sequence
from typing import Any

import numpy as np

from .arrays.device import device_kind
from .engine.protocol import Kind, ReduceOp, Request
from .engine.submission import (
    Prepared,
    check_not_scalar,
    check_splits,
    collective_name,
    host_only,
    outputs,
    prepare,
    prepare_gather,
    root_index,
    run_blocking,
    run_control,
    submit_grouped,
    submit_grouped_reduction,
    submit_reduction,
)
from .engine.submission import blocking as blocking  # re-exported: the adapters use ops.blocking
from .engine.submission import reduction_is_identity as reduction_is_identity  # the adapters
from .engine.submission import refusing_join as refusing_join  # and ops.refusing_join
from .handles import GroupHandle, Handle
from .process import runtime
from .process_sets import ProcessSet, global_process_set


def allreduce_async(tensor: Any, name: str | None = None, op: ReduceOp = ReduceOp.Average,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start an allreduce of ``tensor`` into a new tensor; same semantics as MPI_Allreduce.

    Args:
        tensor: any shape (zero-size and non-contiguous included) and a dtype of
            :data:`gradsync.arrays.dtypes.SUPPORTED`, in host memory or (a torch CUDA tensor, a CuPy array)
            on this rank's GPU; the same shape, dtype and kind of device on every rank. A device
            tensor is reduced on gradsync's CUDA stream: the handle completes when that work is
            enqueued, and synchronize() makes the caller's current stream wait for it
            (docs/gpu.md).
        name: identifies the collective across ranks (see the module docstring).
        op: ``Average`` (default; integer tensors: floor of the mean), ``Sum``, ``Min``, ``Max``,
            ``Product``. bool tensors: Sum/Max are logical or, Min/Product logical and.
            ``Adasum``: the adaptive sum of :mod:`gradsync.executors.adasum` (floating-point host tensors,
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
    return submit_reduction(tensor, name, op, prescale_factor, postscale_factor, False, process_set)


def allreduce_async_(tensor: Any, name: str | None = None, op: ReduceOp = ReduceOp.Average,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """In-place form of :func:`allreduce_async`: the result is written into ``tensor`` itself.

    Do not read or write ``tensor`` until the handle completes. Same arguments and errors as
    :func:`allreduce_async`, plus ValueError for a read-only array.
    """
    return submit_reduction(tensor, name, op, prescale_factor, postscale_factor, True, process_set)


def allreduce(tensor: Any, name: str | None = None, op: ReduceOp = ReduceOp.Average,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> Any:
    """Blocking :func:`allreduce_async`: returns the reduced tensor (a new one)."""
    return run_blocking(process_set, allreduce_async, tensor, name, op, prescale_factor,
                        postscale_factor, process_set)


def allreduce_(tensor: Any, name: str | None = None, op: ReduceOp = ReduceOp.Average,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> Any:
    """Blocking :func:`allreduce_async_`: reduces ``tensor`` in place and returns it."""
    return run_blocking(process_set, allreduce_async_, tensor, name, op, prescale_factor,
                        postscale_factor, process_set)


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
    return submit_grouped_reduction(tensors, name, Kind.ALLREDUCE, op, prescale_factor, postscale_factor,
                              False, process_set)


def grouped_allreduce_async_(tensors: Sequence[Any], name: str | None = None,
                             op: ReduceOp = ReduceOp.Average, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> GroupHandle:
    """In-place :func:`grouped_allreduce_async`: each result is written into its input tensor.

    Same arguments and errors, plus ValueError for a read-only member.
    """
    return submit_grouped_reduction(tensors, name, Kind.ALLREDUCE, op, prescale_factor, postscale_factor,
                              True, process_set)


def grouped_allreduce(tensors: Sequence[Any], name: str | None = None,
                      op: ReduceOp = ReduceOp.Average, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[Any]:
    """Blocking :func:`grouped_allreduce_async`: returns the list of reduced (new) tensors."""
    return run_blocking(process_set, grouped_allreduce_async, tensors, name, op, prescale_factor,
                        postscale_factor, process_set)


def grouped_allreduce_(tensors: Sequence[Any], name: str | None = None,
                       op: ReduceOp = ReduceOp.Average, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[Any]:
    """Blocking :func:`grouped_allreduce_async_`: reduces every tensor in place, returns the list."""
    return run_blocking(process_set, grouped_allreduce_async_, tensors, name, op, prescale_factor,
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
    return submit_reduction(tensor, name, op, prescale_factor, postscale_factor, False, process_set,
                      Kind.REDUCESCATTER)


def reducescatter(tensor: Any, name: str | None = None, op: ReduceOp = ReduceOp.Average,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                  process_set: ProcessSet = global_process_set) -> Any:
    """Blocking :func:`reducescatter_async`: returns this rank's rows of the reduction."""
    return run_blocking(process_set, reducescatter_async, tensor, name, op, prescale_factor,
                        postscale_factor, process_set)


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
    return submit_grouped_reduction(tensors, name, Kind.REDUCESCATTER, op, prescale_factor,
                              postscale_factor, False, process_set)


def grouped_reducescatter(tensors: Sequence[Any], name: str | None = None,
                          op: ReduceOp = ReduceOp.Average, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0,
                          process_set: ProcessSet = global_process_set) -> list[Any]:
    """Blocking :func:`grouped_reducescatter_async`: returns the list of this rank's rows."""
    return run_blocking(process_set, grouped_reducescatter_async, tensors, name, op,
                        prescale_factor, postscale_factor, process_set)


for _grouped_op in (grouped_allreduce_async, grouped_reducescatter_async):
    _grouped_op.__doc__ += _GROUPED_DOC


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
    coordinator, adapter, info, device, where = prepare(tensor, name, Kind.ALLTOALL, process_set)
    host_only(device, Kind.ALLTOALL, where)
    check_not_scalar(info.shape, where)
    splits = check_splits(splits, info.shape[0], coordinator.size, where)

    def allocate(shape: tuple[int, ...], received: list[int]) -> tuple[Any, np.ndarray]:
        output = adapter.empty(tensor, shape)
        received_splits = adapter.from_host(tensor, np.array(received, np.int64))
        return (output, received_splits), adapter.host_view(output)

    request = Request("", Kind.ALLTOALL, coordinator.rank, info.dtype, info.shape, splits=splits)
    return Prepared(coordinator, request, adapter.host_view(tensor), None, None, None,
                     allocate).submit(name, "alltoall")


def alltoall(tensor: Any, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> tuple[Any, Any]:
    """Blocking :func:`alltoall_async`: returns ``(output, received_splits)``."""
    return run_blocking(process_set, alltoall_async, tensor, splits, name, process_set)


def _broadcast(tensor: Any, root_rank: int, name: str | None, in_place: bool,
               process_set: ProcessSet) -> Handle:
    coordinator, adapter, info, device, where = prepare(tensor, name, Kind.BROADCAST, process_set)
    root = root_index(coordinator, root_rank, where)
    source, target, result = outputs(adapter, tensor, info.shape, in_place, where, device)
    request = Request("", Kind.BROADCAST, coordinator.rank, info.dtype, info.shape, root=root,
                      device=device_kind(info.device))
    return Prepared(coordinator, request, source, target, result, device).submit(name, "broadcast")


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
    return run_blocking(process_set, broadcast_async, tensor, root_rank, name, process_set)


def broadcast_(tensor: Any, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> Any:
    """Blocking :func:`broadcast_async_`: overwrites ``tensor`` with the root's values, returns it."""
    return run_blocking(process_set, broadcast_async_, tensor, root_rank, name, process_set)


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
    return prepare_gather(tensor, name, process_set).submit(name, "allgather")


def allgather(tensor: Any, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> Any:
    """Blocking :func:`allgather_async`: returns the concatenated tensor."""
    return run_blocking(process_set, allgather_async, tensor, name, process_set)


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
    return submit_grouped(tensors, name, Kind.ALLGATHER, process_set,
                    lambda tensor, where: prepare_gather(tensor, None, process_set, where))


def grouped_allgather(tensors: Sequence[Any], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[Any]:
    """Blocking :func:`grouped_allgather_async`: returns the list of gathered tensors."""
    return run_blocking(process_set, grouped_allgather_async, tensors, name, process_set)


def barrier(name: str | None = None, process_set: ProcessSet = global_process_set) -> None:
    """Block until every rank (of ``process_set``) has called barrier (same semantics as MPI_Barrier).

    Goes through the coordinator, so it is ordered with the collectives submitted before it.

    Raises:
        ValueError: ``process_set`` not registered or this rank not in it.
    """
    run_control(Kind.BARRIER, name, process_set)


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
    return run_control(Kind.JOIN, None, process_set)


def broadcast_object(obj: Any = None, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Broadcast any picklable object from ``root_rank``; returns the root's object on every rank.

    The object is pickled on the root (arguments on other ranks are ignored), its size broadcast,
    then its bytes. Same errors as :func:`broadcast`; unpickling errors propagate.
    """
    rt = runtime.get()
    where = f"gradsync: rank {rt.rank}: broadcast_object"
    coordinator = rt.coordinator_for(process_set, where)
    root_index(coordinator, root_rank, where)
    name = collective_name(coordinator, name, "broadcast_object")
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
    name = collective_name(coordinator, name, "allgather_object")
    payload = np.frombuffer(pickle.dumps(obj), np.uint8)
    sizes = allgather(np.array([payload.size], np.int64), name=f"{name}.size", process_set=process_set)
    data = allgather(payload.copy(), name=f"{name}.data", process_set=process_set)
    bounds = np.concatenate(([0], np.cumsum(sizes))).tolist()
    return [pickle.loads(data[a:b].tobytes()) for a, b in zip(bounds, bounds[1:])]


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
