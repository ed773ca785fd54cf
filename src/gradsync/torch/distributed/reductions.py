"""The reducing calls of the process group: allreduce (and coalesced), reduce, reduce_scatter.

Each function takes the process group (its process set, names and completer), submits to gradsync's
engine through the public async ops and returns a torch ``Work``. Results land in torch's own
tensors: in place where the engine can write there (allreduce), else copied by the call's finish in
the completion thread. CUDA tensors are allreduced on the GPU (NCCL, or gradsync's staging through
pinned memory); reduce_scatter sends host copies of them (:func:`.movement.host`). Local checks of
torch's arguments that the other ranks cannot see (an output of the wrong size) fail in the
finish, after the collective ran, so that no rank is left waiting.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ... import ops
from ...engine.protocol import ReduceOp
from .movement import gather_rows, host
from .reduce_ops import Reduction, reduction


def _reduction(pg: Any, opts: Any, tensor: torch.Tensor, call: str) -> Reduction:
    return reduction(getattr(opts, "reduceOp", None), tensor.dtype, f"gradsync: {call}")


def _submit_allreduce(pg: Any, tensor: torch.Tensor, how: Reduction, name: str, in_place: bool) -> Any:
    start = ops.allreduce_async_ if in_place else ops.allreduce_async
    return start(tensor, name=name, op=how.op, prescale_factor=how.prescale, process_set=pg.process_set)


def _submit_sparse(pg: Any, tensor: torch.Tensor, how: Reduction, name: str, call: str) -> Any:
    """The sum of a sparse COO tensor, as gloo computes it: every rank's indices and values
    allgathered (their counts may differ), summed into one coalesced tensor. Returns a deferred
    call that gives it.

    Raises:
        TypeError: an op other than SUM (or PREMUL_SUM).
    """
    if how.op is not ReduceOp.Sum or how.fold is not None:
        raise TypeError(f"gradsync: {call}: a sparse tensor can only be summed (ReduceOp.SUM)")
    local = tensor.coalesce()
    values = local.values() if how.prescale == 1.0 else local.values() * how.prescale
    indices = ops.allgather_async(local.indices().t().contiguous(), name=f"{name}.indices",
                                  process_set=pg.process_set)
    gathered = ops.allgather_async(values.contiguous(), name=f"{name}.values", process_set=pg.process_set)
    return lambda: torch.sparse_coo_tensor(indices.wait().t(), gathered.wait(), tensor.shape,
                                           check_invariants=True).coalesce()  # a rank may differ in shape


def _submit_each(pg: Any, tensors: Sequence[torch.Tensor], opts: Any, call: str,
                 in_place: bool) -> tuple[list[Any], list[Any]]:
    """One reduction per tensor under the call's next name (``allreduce`` for ``all_reduce``):
    the engine's allreduce, or for the ops it lacks an allgather to fold on every rank, or for a
    sparse tensor the allgathers of its indices and values. Returns the pending items and each
    tensor's reduction."""
    name = pg.next_name("allreduce" if call == "all_reduce" else call)
    pending, folds = [], []
    for i, tensor in enumerate(tensors):
        how = _reduction(pg, opts, tensor, call)
        if tensor.is_sparse:
            pending.append(_submit_sparse(pg, tensor, how, f"{name}.{i}", call))
        elif how.fold is None:
            pending.append(_submit_allreduce(pg, tensor, how, f"{name}.{i}", in_place))
        else:
            pending.append(gather_rows(pg, tensor, f"{name}.{i}"))
        folds.append(how)
    return pending, folds


def allreduce(pg: Any, tensors: Sequence[torch.Tensor], opts: Any, blocking: bool = False) -> Any:
    """``dist.all_reduce``: every tensor of ``tensors`` reduced in place (a sparse one summed).
    ``blocking`` (the caller waits at once): a lone dense host tensor that the engine reduces is
    finished before this returns (:meth:`.work.Completer.finished`), under the same name."""
    if blocking and len(tensors) == 1 and tensors[0].layout == torch.strided and not tensors[0].is_cuda:
        how = _reduction(pg, opts, tensors[0], "all_reduce")
        if how.fold is None:
            name = f"{pg.next_name('allreduce')}.0"
            return pg.completer.finished(_submit_allreduce(pg, tensors[0], how, name, True))
    pending, folds = _submit_each(pg, tensors, opts, "all_reduce", True)

    def finish(results: list[Any]) -> list[torch.Tensor]:
        for tensor, how, result in zip(tensors, folds, results):
            if how.fold is not None:
                tensor.copy_(how.gathered(result))
            elif tensor.is_sparse:
                tensor.copy_(result)
        return list(tensors)

    return pg.completer.work(pending, finish)


def allreduce_coalesced(pg: Any, tensors: Sequence[torch.Tensor], opts: Any) -> Any:
    """The coalesced allreduce of DDP and ``_coalescing_manager``: one grouped allreduce (one fused
    buffer) when the tensors share a dtype and the op is the engine's, else one allreduce each."""
    tensors = list(tensors)
    if not tensors:
        return pg.completer.done([])
    how = _reduction(pg, opts, tensors[0], "all_reduce_coalesced")
    if how.fold is not None or len({t.dtype for t in tensors}) > 1:
        return allreduce(pg, tensors, opts)
    handle = ops.grouped_allreduce_async_(tensors, name=pg.next_name("allreduce_coalesced"), op=how.op,
                                          prescale_factor=how.prescale, process_set=pg.process_set)
    return pg.completer.work([handle], lambda results: tensors)


def reduce(pg: Any, tensors: Sequence[torch.Tensor], opts: Any) -> Any:
    """``dist.reduce``: the reduction lands in the root's tensors; the others' are left alone."""
    at_root = pg.rank() == opts.rootRank
    pending, folds = _submit_each(pg, tensors, opts, "reduce", False)

    def finish(results: list[Any]) -> list[torch.Tensor]:
        if at_root:
            for tensor, how, result in zip(tensors, folds, results):
                tensor.copy_(result if how.fold is None else how.gathered(result))
        return list(tensors)

    return pg.completer.work(pending, finish)


def _check_numel(tensor: torch.Tensor, numel: int, what: str) -> None:
    if tensor.numel() != numel:
        raise ValueError(f"gradsync: {what}: the output has {tensor.numel()} elements, the input "
                         f"gives {numel} per rank")


def _submit_reducescatter(pg: Any, rows: torch.Tensor, opts: Any, name: str, call: str) -> tuple:
    """A reducescatter of ``rows`` (one row per rank: this rank gets the reduction of its row), as
    (handle, how); a bitwise op gathers every rank's ``rows`` instead."""
    how = _reduction(pg, opts, rows, call)
    if how.fold is not None:
        return gather_rows(pg, rows, name), how
    return ops.reducescatter_async(host(rows), name=name, op=how.op, prescale_factor=how.prescale,
                                   process_set=pg.process_set), how


def _my_row(pg: Any, how: Reduction, result: torch.Tensor) -> torch.Tensor:
    """This rank's reduced row, from a reducescatter's (1, n) or a bitwise gather's (size, size, n)."""
    return result[0] if how.fold is None else how.gathered(result)[pg.rank()]


def reduce_scatter_tensors(pg: Any, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                           opts: Any, call: str) -> Any:
    """``reduce_scatter_tensor`` (and its coalesced form): ``inputs[i]`` holds ``size`` blocks of
    ``outputs[i]``'s size, rank r gets the reduction of block r."""
    name = pg.next_name("reduce_scatter")
    submitted = [_submit_reducescatter(pg, inp.reshape(pg.size(), -1), opts, f"{name}.{i}", call)
                 for i, inp in enumerate(inputs)]

    def finish(results: list[Any]) -> list[torch.Tensor]:
        for output, (_, how), result in zip(outputs, submitted, results):
            row = _my_row(pg, how, result)
            _check_numel(output, row.numel(), call)
            output.copy_(row.reshape(output.shape))
        return list(outputs)

    return pg.completer.work([handle for handle, _ in submitted], finish)


def reduce_scatter(pg: Any, outputs: Sequence[torch.Tensor], input_lists: Sequence[Sequence[torch.Tensor]],
                   opts: Any) -> Any:
    """``dist.reduce_scatter``: ``input_lists[i][r]`` reduced over the ranks lands in rank r's
    ``outputs[i]``."""
    stacked = []
    for inputs in input_lists:
        if len(inputs) != pg.size():
            raise ValueError(f"gradsync: reduce_scatter: {len(inputs)} input tensors for "
                             f"{pg.size()} ranks")
        stacked.append(torch.stack([t.reshape(-1) for t in inputs]))
    return reduce_scatter_tensors(pg, outputs, stacked, opts, "reduce_scatter")
