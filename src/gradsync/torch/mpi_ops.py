"""Horovod's torch collectives (``horovod.torch.mpi_ops`` 0.28.1) on gradsync.

The signatures, argument order, defaults and results are Horovod's; the work is done by
:mod:`gradsync.ops`, so every op is negotiated by the coordinator like gradsync's own. What Horovod
does differently from gradsync's core ops, and these functions therefore do too:

* ``average=`` (deprecated in Horovod, still accepted): True is ``op=Average``, False ``op=Sum``;
  ``op=None`` means Average.
* Integer tensors are scaled as Horovod scales them: ``Average`` is the sum times ``1/divisor`` in
  float64, truncated toward zero (gradsync's core rounds down), and pre/postscale factors apply to
  integers too (in float64, truncated), where gradsync's core refuses them.
* ``allreduce``, ``grouped_allreduce``, ``allgather``, ``grouped_allgather``, ``broadcast``,
  ``alltoall``, ``reducescatter`` and ``grouped_reducescatter`` are autograd functions with
  Horovod's gradients: allreduce's is the allreduce (same op and factors) of the output's gradient;
  allgather's this rank's rows of the *averaged* gradient; broadcast's the averaged gradient on the
  root and zeros elsewhere; alltoall's the alltoall back along the received splits;
  reducescatter's the allgather of the gradient, times the set's size for ``Sum`` and times the
  scale factors. For ``op=Sum`` allreduce and reducescatter, and for alltoall, that is the gradient
  of the sum of every rank's loss; for allgather and broadcast, of their average.
* CUDA tensors of reducescatter, alltoall and Adasum, which gradsync reduces in host memory only,
  are staged through host memory.
* While some rank has called :func:`join`, allgather, broadcast, alltoall and reducescatter (and
  their grouped forms) fail with a CollectiveError on every rank, as Horovod's do ("... is not
  supported with Join"); gradsync's core ops run them with the joined ranks' stand-ins. Allreduce,
  and the optimizer's own collectives (sparse gradients included), work beside a joined rank.

Errors are gradsync's (all RuntimeErrors, and :data:`HorovodInternalError` is their base class),
raised where gradsync raises them: bad input at the call, disagreement between ranks from
:func:`synchronize`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .. import ops
from ..engine.protocol import ReduceOp
from ..handles import GroupHandle, Handle
from ..ops import poll, synchronize
from ..process_sets import ProcessSet, global_process_set
from . import basics as _basics
from .alltoall import HorovodAlltoall, alltoall, alltoall_async
from .basics import *  # noqa: F403 - Horovod's mpi_ops exports the basics too
from .basics import Average, Sum, handle_average_backwards_compatibility, rank
from .collectives import grad_name, reduce_async, sparse_allreduce_async
from .compression import Compression

_NONE6 = (None,) * 6


# ---- reductions (allreduce, grouped allreduce, reducescatter, grouped reducescatter) -------------
# reduce_async (gradsync.torch.collectives): Horovod's integer scaling and GPU staging.

def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: ReduceOp | None = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start an allreduce of ``tensor`` into a new tensor (``horovod.torch.allreduce_async``).

    Same semantics as MPI_Allreduce. ``tensor``: any shape, a dtype gradsync supports, on the CPU
    or this rank's GPU, alike on every rank. ``op``: Average (default), Sum, Min, Max, Product or
    Adasum; ``average``: deprecated, True for Average, False for Sum. ``prescale_factor`` and
    ``postscale_factor`` multiply before and after the reduction (integers: in float64, truncated).

    Returns:
        A handle for :func:`synchronize` (the new tensor) and :func:`poll`.

    Raises:
        ValueError: both ``op`` and ``average``; an unknown op; a name still in flight.
        TypeError: unsupported tensor or dtype. NotImplementedError: Adasum on a number of ranks
            that is not a power of two. CollectiveError (from synchronize): ranks disagree.
    """
    op = handle_average_backwards_compatibility(op, average)
    return reduce_async([tensor], False, name, op, prescale_factor, postscale_factor, process_set)


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: ReduceOp | None = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """In-place :func:`allreduce_async` (``horovod.torch.allreduce_async_``): the result is written
    into ``tensor``; do not touch it until the handle completes. Same arguments and errors."""
    op = handle_average_backwards_compatibility(op, average)
    return reduce_async([tensor], True, name, op, prescale_factor, postscale_factor, process_set)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: ReduceOp | None = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Blocking :func:`allreduce_async_` (``horovod.torch.allreduce_``): returns ``tensor``."""
    with ops.blocking(process_set):
        return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                            postscale_factor, process_set))


class HorovodAllreduce(torch.autograd.Function):
    """Allreduce as an autograd function: the gradient is the allreduce of the output's gradient
    with the same op and scale factors (Horovod's)."""

    @staticmethod
    def forward(ctx, tensor, average, name, op, prescale_factor, postscale_factor, process_set):
        ctx.args = (average, op, prescale_factor, postscale_factor, process_set)
        with ops.blocking(process_set):
            handle = allreduce_async(tensor, average, name, op, prescale_factor, postscale_factor,
                                     process_set)
            ctx.name = handle.name
            return synchronize(handle)

    @staticmethod
    def backward(ctx, grad_output):
        average, op, prescale, postscale, process_set = ctx.args
        grad = allreduce(grad_output.contiguous(), average, grad_name(ctx.name), op=op,
                         prescale_factor=prescale, postscale_factor=postscale,
                         process_set=process_set)
        return (grad, *_NONE6)


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: Any = Compression.none, op: ReduceOp | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Allreduce ``tensor`` into a new tensor, differentiably (``horovod.torch.allreduce``).

    ``compression`` (e.g. ``Compression.fp16``) applies around the reduction; the other arguments
    and errors are those of :func:`allreduce_async`. The gradient is the allreduce of the output's
    gradient, same op and factors (module docstring).
    """
    op = handle_average_backwards_compatibility(op, average)
    compressed, context = compression.compress(tensor)
    reduced = HorovodAllreduce.apply(compressed, None, name, op, prescale_factor, postscale_factor,
                                     process_set)
    return compression.decompress(reduced, context)


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: ReduceOp | None = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> GroupHandle:
    """Start an allreduce of every tensor of ``tensors`` as one unit, into new tensors
    (``horovod.torch.grouped_allreduce_async``; see :func:`gradsync.grouped_allreduce_async`: one
    dtype, negotiated and fused together, all-or-nothing on error). Arguments as
    :func:`allreduce_async`; :func:`synchronize` returns the list of results."""
    op = handle_average_backwards_compatibility(op, average)
    return reduce_async(tensors, False, name, op, prescale_factor, postscale_factor, process_set,
                   grouped=True)


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: ReduceOp | None = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> GroupHandle:
    """In-place :func:`grouped_allreduce_async` (``horovod.torch.grouped_allreduce_async_``)."""
    op = handle_average_backwards_compatibility(op, average)
    return reduce_async(tensors, True, name, op, prescale_factor, postscale_factor, process_set,
                   grouped=True)


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                       name: str | None = None, op: ReduceOp | None = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Blocking :func:`grouped_allreduce_async_`: returns the list of ``tensors``."""
    with ops.blocking(process_set):
        return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                    postscale_factor, process_set))


class HorovodGroupedAllreduce(torch.autograd.Function):
    """Grouped allreduce as an autograd function: each member's gradient is the grouped allreduce
    of the outputs' gradients (Horovod's)."""

    @staticmethod
    def forward(ctx, average, name, op, prescale_factor, postscale_factor, process_set, *tensors):
        ctx.args = (average, op, prescale_factor, postscale_factor, process_set)
        with ops.blocking(process_set):
            handle = grouped_allreduce_async(list(tensors), average, name, op, prescale_factor,
                                             postscale_factor, process_set)
            ctx.name = handle.name
            return tuple(synchronize(handle))

    @staticmethod
    def backward(ctx, *grad_output):
        average, op, prescale, postscale, process_set = ctx.args
        grads = grouped_allreduce([g.contiguous() for g in grad_output], average,
                                  grad_name(ctx.name), op=op, prescale_factor=prescale,
                                  postscale_factor=postscale, process_set=process_set)
        return (*_NONE6, *grads)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None,
                      name: str | None = None, compression: Any = Compression.none,
                      op: ReduceOp | None = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allreduce ``tensors`` as one unit into new tensors, differentiably
    (``horovod.torch.grouped_allreduce``); arguments as :func:`grouped_allreduce_async` plus
    ``compression``. Returns the list of results."""
    op = handle_average_backwards_compatibility(op, average)
    compressed, contexts = zip(*[compression.compress(t) for t in tensors]) if tensors else ((), ())
    reduced = HorovodGroupedAllreduce.apply(None, name, op, prescale_factor, postscale_factor,
                                            process_set, *compressed)
    return [compression.decompress(t, c) for t, c in zip(reduced, contexts)]


# ---- allgather, broadcast --------------------------------------------------------------------------

def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start an allgather (``horovod.torch.allgather_async``): every rank's ``tensor`` concatenated
    along dimension 0 in rank order; dimension 0 may differ between ranks (MPI_Allgatherv). See
    :func:`gradsync.allgather_async` for errors; as Horovod's, it fails (CollectiveError, on every
    rank) while some rank has called :func:`join`."""
    with ops.refusing_join():
        return ops.allgather_async(tensor, name, process_set)


class HorovodAllgather(torch.autograd.Function):
    """Allgather as an autograd function: the gradient is this rank's rows of the averaged output
    gradient (Horovod's)."""

    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.dim, ctx.process_set = tensor.shape[0] if tensor.dim() else 0, process_set
        with ops.blocking(process_set):
            handle = allgather_async(tensor, name, process_set)
            ctx.name = handle.name
            return synchronize(handle)

    @staticmethod
    def backward(ctx, grad_output):
        grad, = _own_rows(ctx.name, [grad_output], [ctx.dim], ctx.process_set)
        return grad, None, None


def _own_rows(name: str, grads: Sequence[torch.Tensor], dims: Sequence[int],
              process_set: ProcessSet) -> list[torch.Tensor]:
    """This rank's rows of each averaged gradient of a (grouped) allgather: the averages in one
    grouped allreduce, every rank's first dimensions in one allgather."""
    averaged = ops.grouped_allreduce([g.contiguous() for g in grads], grad_name(name),
                                     op=Average, process_set=process_set)
    every = ops.allgather(torch.tensor([list(dims)], dtype=torch.int64), f"{name}.grad.dims",
                          process_set=process_set)
    offsets = every[:process_set.rank()].sum(dim=0).tolist()
    return [g.narrow(0, int(o), d) for g, o, d in zip(averaged, offsets, dims)]


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Allgather ``tensor``, differentiably (``horovod.torch.allgather``): as
    :func:`allgather_async`; the gradient is this rank's rows of the averaged output gradient."""
    return HorovodAllgather.apply(tensor, name, process_set)


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> GroupHandle:
    """Start an allgather of every tensor of ``tensors`` as one group
    (``horovod.torch.grouped_allgather_async``; :func:`gradsync.grouped_allgather_async`: one dtype,
    negotiated and moved together, all-or-nothing on error). :func:`synchronize` returns the list
    of gathered tensors; members are named ``name.0``, ... As Horovod's, it fails (CollectiveError,
    on every rank) while some rank has called :func:`join`."""
    with ops.refusing_join():
        return ops.grouped_allgather_async(tensors, name, process_set)


class HorovodGroupedAllgather(torch.autograd.Function):
    """Grouped allgather as an autograd function: each member's gradient is this rank's rows of
    its averaged output gradient (Horovod's)."""

    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.dims = [t.shape[0] if t.dim() else 0 for t in tensors]
        ctx.process_set = process_set
        with ops.blocking(process_set):
            handle = grouped_allgather_async(list(tensors), name, process_set)
            ctx.name = handle.name
            return tuple(synchronize(handle))

    @staticmethod
    def backward(ctx, *grad_output):
        return (None, None, *_own_rows(ctx.name, grad_output, ctx.dims, ctx.process_set))


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allgather every tensor of ``tensors``, differentiably (``horovod.torch.grouped_allgather``);
    returns the list of gathered tensors. Errors as :func:`grouped_allgather_async`."""
    return list(HorovodGroupedAllgather.apply(name, process_set, *tensors))


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start a broadcast of ``root_rank``'s ``tensor`` into a new tensor on every rank
    (``horovod.torch.broadcast_async``; MPI_Bcast). ``root_rank`` is a world rank. See
    :func:`gradsync.broadcast_async` for errors; as Horovod's, it fails (CollectiveError, on every
    rank) while some rank has called :func:`join`."""
    with ops.refusing_join():
        return ops.broadcast_async(tensor, root_rank, name, process_set)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """In-place :func:`broadcast_async` (``horovod.torch.broadcast_async_``)."""
    with ops.refusing_join():
        return ops.broadcast_async_(tensor, root_rank, name, process_set)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Blocking :func:`broadcast_async_` (``horovod.torch.broadcast_``): returns ``tensor``."""
    with ops.refusing_join():
        return ops.broadcast_(tensor, root_rank, name, process_set)


class HorovodBroadcast(torch.autograd.Function):
    """Broadcast as an autograd function: the gradient is the averaged output gradient on the root,
    zeros on the other ranks (Horovod's)."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        with ops.blocking(process_set):
            handle = broadcast_async(tensor, root_rank, name, process_set)
            ctx.name = handle.name
            return synchronize(handle)

    @staticmethod
    def backward(ctx, grad_output):
        grad = ops.allreduce(grad_output.contiguous(), grad_name(ctx.name), op=Average,
                             process_set=ctx.process_set)
        if rank() != ctx.root_rank:
            grad = torch.zeros_like(grad)
        return grad, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Broadcast ``tensor`` from ``root_rank`` into a new tensor, differentiably
    (``horovod.torch.broadcast``); as :func:`broadcast_async`. The gradient is the averaged output
    gradient on the root, zeros elsewhere."""
    return HorovodBroadcast.apply(tensor, root_rank, name, process_set)


# ---- reducescatter --------------------------------------------------------------------------------

def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: ReduceOp = Average,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> Handle:
    """Start a reducescatter (``horovod.torch.reducescatter_async``; note Horovod's argument order:
    ``process_set`` before the factors). Each rank gets its block of rows of the reduction: with N
    rows, rank r of the set gets ``N // size`` rows, plus one if ``r < N % size``. Average, Sum,
    Min, Max, Product; integers scaled as in :func:`allreduce_async`.

    Raises:
        NotImplementedError: ``op=Adasum`` (a RuntimeError, as Horovod's). ValueError: a 0-d
            tensor. Others as :func:`allreduce_async`.
    """
    return reduce_async([tensor], False, name, op, prescale_factor, postscale_factor, process_set,
                   scatter=True)


class HorovodReducescatter(torch.autograd.Function):
    """Reducescatter as an autograd function: the gradient is the allgather of the output's
    gradient, times the set's size for Sum and times the scale factors (Horovod's)."""

    @staticmethod
    def forward(ctx, tensor, name, op, process_set, prescale_factor, postscale_factor):
        ctx.args = (op, process_set, prescale_factor * postscale_factor)
        with ops.blocking(process_set):
            handle = reducescatter_async(tensor, name, op, process_set, prescale_factor, postscale_factor)
            ctx.name = handle.name
            return synchronize(handle)

    @staticmethod
    def backward(ctx, grad_output):
        op, process_set, factor = ctx.args
        grad = _scatter_grad(grad_output, op, process_set, factor)
        return ops.allgather(grad, grad_name(ctx.name), process_set), *(None,) * 5


def _scatter_grad(grad: torch.Tensor, op: ReduceOp, process_set: ProcessSet,
                  factor: float) -> torch.Tensor:
    if op == Sum:
        factor *= process_set.size()
    return (grad * factor if factor != 1.0 else grad).contiguous()


def reducescatter(tensor: torch.Tensor, name: str | None = None,
                  compression: Any = Compression.none, op: ReduceOp = Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reducescatter ``tensor``, differentiably (``horovod.torch.reducescatter``): as
    :func:`reducescatter_async`, with ``compression`` around it."""
    compressed, context = compression.compress(tensor)
    reduced = HorovodReducescatter.apply(compressed, name, op, process_set, prescale_factor,
                                         postscale_factor)
    return compression.decompress(reduced, context)


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                                op: ReduceOp = Average,
                                process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> GroupHandle:
    """Start a reducescatter of every tensor of ``tensors`` as one unit
    (``horovod.torch.grouped_reducescatter_async``; see :func:`gradsync.grouped_reducescatter_async`);
    arguments and errors as :func:`reducescatter_async`."""
    return reduce_async(tensors, False, name, op, prescale_factor, postscale_factor, process_set,
                   scatter=True, grouped=True)


class HorovodGroupedReducescatter(torch.autograd.Function):
    """Grouped reducescatter as an autograd function: each member's gradient is as
    :class:`HorovodReducescatter`'s, the allgathers grouped (Horovod's)."""

    @staticmethod
    def forward(ctx, name, op, process_set, prescale_factor, postscale_factor, *tensors):
        ctx.args = (op, process_set, prescale_factor * postscale_factor)
        with ops.blocking(process_set):
            handle = grouped_reducescatter_async(list(tensors), name, op, process_set, prescale_factor,
                                                 postscale_factor)
            ctx.name = handle.name
            return tuple(synchronize(handle))

    @staticmethod
    def backward(ctx, *grad_output):
        op, process_set, factor = ctx.args
        grads = [_scatter_grad(g, op, process_set, factor) for g in grad_output]
        return (*(None,) * 5, *synchronize(grouped_allgather_async(grads, grad_name(ctx.name),
                                                                   process_set)))


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression: Any = Compression.none, op: ReduceOp = Average,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """Reducescatter ``tensors`` as one unit, differentiably
    (``horovod.torch.grouped_reducescatter``); returns the list of this rank's blocks."""
    compressed, contexts = zip(*[compression.compress(t) for t in tensors]) if tensors else ((), ())
    reduced = HorovodGroupedReducescatter.apply(name, op, process_set, prescale_factor,
                                                postscale_factor, *compressed)
    return [compression.decompress(t, c) for t, c in zip(reduced, contexts)]


# ---- control --------------------------------------------------------------------------------------

def join(device: int = -1) -> int:
    """This rank has no more data: take part in the others' collectives until every rank joined
    (``horovod.torch.join``; see :func:`gradsync.join`). ``device`` is accepted for Horovod's
    sake and not needed. Returns the rank that joined last."""
    return ops.join()


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every rank of ``process_set`` has called it (``horovod.torch.barrier``; note
    Horovod's argument: the process set comes first). See :func:`gradsync.barrier`."""
    ops.barrier(process_set=process_set)


__all__ = [
    "allreduce", "allreduce_async", "allreduce_", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_async", "grouped_allreduce_", "grouped_allreduce_async_",
    "sparse_allreduce_async", "allgather", "allgather_async", "grouped_allgather",
    "grouped_allgather_async", "broadcast", "broadcast_async", "broadcast_", "broadcast_async_",
    "alltoall", "alltoall_async", "reducescatter", "reducescatter_async", "grouped_reducescatter",
    "grouped_reducescatter_async", "join", "barrier", "poll", "synchronize",
    "HorovodAllreduce", "HorovodGroupedAllreduce", "HorovodAllgather", "HorovodGroupedAllgather",
    "HorovodBroadcast", "HorovodAlltoall", "HorovodReducescatter", "HorovodGroupedReducescatter",
    *_basics.__all__,  # Horovod's mpi_ops exports the basics too
]
