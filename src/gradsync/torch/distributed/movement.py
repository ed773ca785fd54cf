"""The calls of the process group that move data without reducing it: broadcast, the gathers,
scatter, the all-to-alls and barrier (same conventions as :mod:`.reductions`).

gather and scatter have no engine op of their own: gather is an allgather whose result only the
root keeps, scatter an alltoall in which only the root sends (one row to each rank). CUDA tensors
go through the engine's GPU path where it has one (broadcast, the allgathers); the all-to-alls
(and scatter) send host copies of them (:func:`host`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ... import ops
from .work import seconds


def broadcast(pg: Any, tensors: Sequence[torch.Tensor], opts: Any) -> Any:
    """``dist.broadcast``: the root's tensors, in place on every rank."""
    name = pg.next_name("broadcast")
    root = pg.world_rank(opts.rootRank)
    pending = [ops.broadcast_async_(tensor, root, name=f"{name}.{i}", process_set=pg.process_set)
               for i, tensor in enumerate(tensors)]
    return pg.completer.work(pending, lambda results: list(tensors))


def host(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in host memory, for the engine's collectives that run there only (alltoall,
    reducescatter): itself, or a copy of a CUDA tensor. The copy waits for the work enqueued on
    the current stream, so it holds what the caller's kernels wrote; the call's finish copies the
    host results into the CUDA outputs."""
    return tensor.cpu() if tensor.is_cuda else tensor


def gather_rows(pg: Any, tensor: torch.Tensor, name: str) -> Any:
    """An allgather handle of ``tensor`` as one row per rank: its result is (size, *shape)."""
    return ops.allgather_async(tensor.reshape(1, *tensor.shape), name=name, process_set=pg.process_set)


def _copy_pieces(outputs: Sequence[torch.Tensor], gathered: torch.Tensor, call: str) -> None:
    """Copy ``gathered`` (flat, or one row per output) into ``outputs``, in order."""
    flat = gathered.reshape(-1)
    sizes = [output.numel() for output in outputs]
    if sum(sizes) != flat.numel():
        raise ValueError(f"gradsync: {call}: the outputs hold {sum(sizes)} elements, the ranks sent "
                         f"{flat.numel()}")
    for output, piece in zip(outputs, flat.split(sizes)):
        output.copy_(piece.reshape(output.shape))


def allgather(pg: Any, output_lists: Sequence[Sequence[torch.Tensor]], inputs: Sequence[torch.Tensor],
              opts: Any = None, call: str = "all_gather") -> Any:
    """``dist.all_gather``: rank r's ``inputs[i]`` into ``output_lists[i][r]`` on every rank. When
    every output has the input's shape the engine checks the ranks agree on it; otherwise (uneven
    sizes) the flattened tensors are gathered."""
    name = pg.next_name("allgather")
    pending = []
    for i, (outputs, tensor) in enumerate(zip(output_lists, inputs)):
        if all(output.shape == tensor.shape for output in outputs):
            pending.append(gather_rows(pg, tensor, f"{name}.{i}"))
        else:
            pending.append(ops.allgather_async(tensor.reshape(-1), name=f"{name}.{i}",
                                               process_set=pg.process_set))

    def finish(results: list[Any]) -> list[torch.Tensor]:
        for outputs, gathered in zip(output_lists, results):
            _copy_pieces(outputs, gathered, call)
        return [output for outputs in output_lists for output in outputs]

    return pg.completer.work(pending, finish)


def allgather_into(pg: Any, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                   opts: Any = None) -> Any:
    """``all_gather_into_tensor`` (and its coalesced form): every rank's ``inputs[i]`` concatenated
    (or stacked: the memory is the same) into ``outputs[i]``."""
    name = pg.next_name("allgather_into")
    pending = [gather_rows(pg, tensor, f"{name}.{i}") for i, tensor in enumerate(inputs)]

    def finish(results: list[Any]) -> list[torch.Tensor]:
        for output, gathered in zip(outputs, results):
            _copy_pieces([output], gathered, "all_gather_into_tensor")
        return list(outputs)

    return pg.completer.work(pending, finish)


def gather(pg: Any, output_lists: Sequence[Sequence[torch.Tensor]], inputs: Sequence[torch.Tensor],
           opts: Any) -> Any:
    """``dist.gather``: every rank's tensor into the root's list (empty on the other ranks)."""
    name = pg.next_name("gather")
    at_root = pg.rank() == opts.rootRank
    pending = [gather_rows(pg, tensor, f"{name}.{i}") for i, tensor in enumerate(inputs)]

    def finish(results: list[Any]) -> list[torch.Tensor]:
        if not at_root:
            return []
        for outputs, gathered in zip(output_lists, results):
            _copy_pieces(outputs, gathered, "gather")
        return [output for outputs in output_lists for output in outputs]

    return pg.completer.work(pending, finish)


def scatter(pg: Any, outputs: Sequence[torch.Tensor], input_lists: Sequence[Sequence[torch.Tensor]],
            opts: Any) -> Any:
    """``dist.scatter``: the root's ``input_lists[0][r]`` into rank r's ``outputs[0]``, as an
    alltoall in which only the root sends (one row of ``outputs[0]``'s size to each rank)."""
    name = pg.next_name("scatter")
    at_root = pg.rank() == opts.rootRank
    pending = []
    for i, output in enumerate(outputs):
        if at_root:
            rows = torch.stack([t.reshape(-1) for t in input_lists[i]]).to(output.dtype)
            splits = [1] * pg.size()
        else:
            rows = output.new_empty((0, output.numel()))
            splits = [0] * pg.size()
        pending.append(ops.alltoall_async(host(rows), splits=splits, name=f"{name}.{i}",
                                          process_set=pg.process_set))

    def finish(results: list[Any]) -> list[torch.Tensor]:
        for output, (received, _) in zip(outputs, results):
            _copy_pieces([output], received, "scatter")
        return list(outputs)

    return pg.completer.work(pending, finish)


def alltoall(pg: Any, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], opts: Any) -> Any:
    """``dist.all_to_all``: this rank's ``inputs[r]`` into rank r's ``outputs[this rank]``; tensors
    of any sizes (flattened, one alltoall)."""
    if len(inputs) != pg.size() or len(outputs) != pg.size():
        raise ValueError(f"gradsync: all_to_all: {len(inputs)} inputs and {len(outputs)} outputs "
                         f"for {pg.size()} ranks")
    flat = torch.cat([tensor.reshape(-1) for tensor in inputs])
    handle = ops.alltoall_async(host(flat), splits=[tensor.numel() for tensor in inputs],
                                name=pg.next_name("alltoall"), process_set=pg.process_set)

    def finish(results: list[Any]) -> list[torch.Tensor]:
        _copy_pieces(outputs, results[0][0], "all_to_all")
        return list(outputs)

    return pg.completer.work([handle], finish)


def alltoall_single(pg: Any, output: torch.Tensor, tensor: torch.Tensor, output_splits: Sequence[int],
                    input_splits: Sequence[int], opts: Any = None) -> Any:
    """``dist.all_to_all_single``: rows of ``tensor`` (dimension 0) to each rank by
    ``input_splits`` (empty: evenly); ``output`` receives each rank's rows in rank order."""
    rows = tensor.reshape(1) if tensor.dim() == 0 else tensor
    handle = ops.alltoall_async(host(rows), splits=list(input_splits) or None,
                                name=pg.next_name("alltoall_single"), process_set=pg.process_set)

    def finish(results: list[Any]) -> list[torch.Tensor]:
        received, splits = results[0]
        if list(output_splits) and list(output_splits) != splits.tolist():
            raise ValueError(f"gradsync: all_to_all_single: output_split_sizes={list(output_splits)}, "
                             f"but the ranks sent {splits.tolist()} rows")
        _copy_pieces([output], received, "all_to_all_single")
        return [output]

    return pg.completer.work([handle], finish)


def barrier(pg: Any, opts: Any = None) -> Any:
    """``dist.barrier``: gradsync's barrier, ordered after this group's earlier calls, run by the
    completion thread so that ``async_op=True`` returns at once; ``timeout=`` (or the group's)
    bounds it."""
    name = pg.next_name("barrier")
    return pg.completer.work([lambda: ops.barrier(name=name, process_set=pg.process_set)],
                             lambda results: [], timeout=seconds(getattr(opts, "timeout", None)),
                             what=f"barrier {name}")
