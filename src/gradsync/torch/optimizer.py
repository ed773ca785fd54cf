"""``gradsync.DistributedOptimizer``: the function users call; it checks the arguments, picks the
reduction strategy and wraps the optimizer in place.

The pieces live along the seams of the design: :mod:`gradsync.torch.reducer.periods` (the optimizer mixin:
periods, hooks' bookkeeping, the end-of-backward wait, closures, step/zero_grad/synchronize),
:mod:`gradsync.torch.reducer.strategies` (what one round submits: per gradient, small-gradient buckets,
buckets with a hook, bucket views, Adasum deltas), :mod:`gradsync.torch.reducer.factory` (argument
checks, :func:`~gradsync.torch.reducer.factory.pick_strategy`, the in-place wrap) and
:mod:`gradsync.torch.reducer.parameter_check` (the first step's parameter comparison).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..compression import Compression, Compressor
from ..engine.protocol import ReduceOp
from ..process import runtime
from ..process_sets import ProcessSet, global_process_set
from .comm_hooks import CommHook
from .reducer.factory import (
    Arguments,
    check_arguments,
    check_hook,
    check_names,
    pick_strategy,
    wrap_in_place,
)
from .reducer.periods import _DistributedOptimizer

__all__ = ["DistributedOptimizer"]


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                         compression: Compressor = Compression.none,
                         backward_passes_per_step: int = 1, op: ReduceOp = ReduceOp.Average,
                         gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups: int | list[list[torch.Tensor]] | None = None,
                         sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set,
                         synchronize_in_backward: bool = True,
                         comm_hook: CommHook | None = None,
                         gradient_as_bucket_view: bool | None = None) -> torch.optim.Optimizer:
    """Make ``optimizer`` data-parallel: gradients are allreduced while backward runs.

    A post-accumulate-grad hook on every parameter with ``requires_grad`` hands its gradient over
    as soon as backward has produced it, so communication overlaps the rest of backward. By
    default a gradient of ``GRADSYNC_SMALL_GRADIENT_BYTES`` (256 KiB) or more starts its own
    asynchronous in-place allreduce there; smaller ones are copied into buckets of up to 25 MiB
    (cut once, in reverse parameter order per (device, dtype), as DDP's), and a bucket's last
    gradient starts one allreduce of the whole bucket, whose result is copied back (see
    ``comm_hook`` below for when each gradient goes alone, and the other reductions:
    :mod:`gradsync.torch.reducer.strategies`). The backward pass that completes a step's gradients
    waits for them before it returns (as DDP does), so code between ``backward()`` and ``step()`` (gradient
    clipping, norm logging, ``GradScaler.unscale_``) sees the averaged gradients; ``step()`` then
    runs the wrapped optimizer's step. With ``op=Average`` and equal per-rank batches, N ranks
    compute the same update as one process on the N-times larger batch (same semantics, and the
    same argument order, as Horovod's ``hvd.DistributedOptimizer``; ``synchronize_in_backward``
    is gradsync's own, after Horovod's arguments).

    Every rank reduces every parameter once per step whatever its data: a rank whose backward
    produced no gradient for a parameter (an unused branch, a loss not connected to the
    parameters) contributes zeros at ``step()`` (or ``synchronize()``), so no rank waits forever.
    ``step(closure)`` averages the gradients and the loss of every closure evaluation (LBFGS).
    docs/getting-started.md, "What you can do after backward()", has the whole contract.

    The first ``step()`` also compares the ranks' parameters (one small allreduce) and logs a
    warning naming those that differ: the usual sign of a missing
    :func:`gradsync.broadcast_parameters`.

    The optimizer is wrapped *in place* (its class becomes a subclass that adds synchronisation)
    and returned, so its state, param groups and any reference to it stay valid. Create LR
    schedulers after wrapping.

    Args:
        optimizer: any ``torch.optim.Optimizer`` over host (CPU) or CUDA parameters (one GPU per
            rank; see docs/gpu.md).
        named_parameters: ``model.named_parameters()``; names identify gradients across ranks and
            appear in errors. Without it, parameters are named by position ("param.<group>.<index>").
        compression: how gradients travel: ``gradsync.Compression.none`` (default), ``.fp16`` or
            ``.bf16`` (float32/float64 gradients are cast to 16 bits before fusion and back after
            the allreduce), or any object with ``compress``/``decompress``
            (:class:`gradsync.compression.Compressor`). Sparse gradients are not compressed.
        backward_passes_per_step: backward passes accumulated locally before the allreduce
            (gradient accumulation); gradients are summed over the passes, as in plain PyTorch.
        op: ``Average`` (default) or ``Sum`` of the gradients across ranks, or ``Adasum``: then
            the wrapped optimizer steps on each rank's own gradients and the *updates* are
            combined by Adasum (:class:`gradsync.torch.reducer.strategies.AdasumDeltas`; a power-of-two
            number of ranks), as Horovod's Adasum optimizer; gradients stay this rank's own.
        gradient_predivide_factor: with Average, gradients are multiplied by 1/f before the sum and
            by f/size after it (to keep low-precision sums in range).
        num_groups: as ``groups=N`` (Horovod's older name for it).
        groups: None or 0 (default): no groups; the default reduction (small gradients in
            buckets, see ``comm_hook``; the others allreduced alone as soon as they are ready, and
            fused with others that happen to be ready at the same time). An int N > 0:
            the parameters, in the optimizer's order, are cut into N groups as evenly as possible.
            A list of lists of parameters: those groups (parameters in none are reduced on their
            own). Each group is reduced by one :func:`gradsync.grouped_allreduce_async_` (per
            gradient dtype) once all its gradients are ready: fewer, larger, predictable fusion
            buffers, as Horovod's ``groups``. Parameters added later with ``add_param_group`` are
            reduced on their own.
        sparse_as_dense: sparse gradients (``nn.Embedding(sparse=True)``) are densified,
            allreduced like the others, and made sparse again when the round ends (as Horovod's,
            so ``SparseAdam`` still gets sparse gradients). By default they are reduced by
            :func:`gradsync.torch.sparse_allreduce_async` (an allgather of their indices and
            values), and ``param.grad`` becomes the coalesced sparse sum (divided by the number
            of ranks for Average): cheaper when few rows are touched. A rank on which such a
            parameter got no gradient in a step contributes no rows.
        process_set: the ranks among which gradients are averaged (default: every rank); Average
            divides by its size. On a rank outside it the optimizer reduces nothing and steps on
            that rank's own gradients (as Horovod's).
        synchronize_in_backward: True (default): the step's last backward pass waits for its
            allreduces before returning (on a GPU, the current stream waits; the host does not).
            False: Horovod's timing: ``step()`` or ``synchronize()`` waits, and gradients must not
            be read or changed before (an in-place change or a replaced ``p.grad`` raises there).
        comm_hook: None (default): each gradient of ``GRADSYNC_SMALL_GRADIENT_BYTES`` (256 KiB)
            or more is allreduced on its own, as above; smaller ones are copied into buckets
            (reverse parameter order, per (device, dtype), up to 25 MiB or the fusion threshold if
            larger), one allreduce per bucket, the results copied back: the same numbers, fewer
            collectives (not with ``gradient_as_bucket_view``, ``groups``/``num_groups``, a
            ``compression`` or ``op=Adasum``: then every gradient alone; docs/comm-hooks.md). A
            communication hook (:mod:`gradsync.torch.comm_hooks`; docs/comm-hooks.md): the
            parameters are cut into buckets (by (device, dtype), in reverse order, up to the fusion
            threshold, or the ``groups`` / ``num_groups`` groups), and each bucket, once all its
            gradients are ready, is handed to ``comm_hook(bucket)`` as one flat buffer:
            :func:`gradsync.allreduce_hook`, :func:`gradsync.fp16_compress_hook`,
            :func:`gradsync.bf16_compress_hook`, :class:`gradsync.PowerSGD`, or your own.
            Sparse gradients are still allgathered on their own. Not with ``compression``,
            ``gradient_predivide_factor`` (a hook replaces both) or ``op=Adasum``.
        gradient_as_bucket_view: each ``p.grad`` is a view into its bucket's buffer, so autograd
            accumulates straight into it and the bucket is reduced in place with no copy (DDP's
            ``gradient_as_bucket_view``); a gradient that is not the view (after
            ``zero_grad(set_to_none=True)``, or a replaced ``p.grad``) is copied in once and
            ``p.grad`` re-pointed at the view. None (default): True with a ``comm_hook``, else
            False (and small gradients copied into buckets, above). True without a hook buckets
            the gradients with the default allreduce
            (``compression`` and ``gradient_predivide_factor`` apply to each bucket). False with a
            hook: gradients are copied into the buckets and the results copied back.

    Raises:
        ValueError: a parameter already reduced by another DistributedOptimizer (named), duplicate
            names or names that are not (name, tensor) pairs (checked before anything else, also
            before ``gradsync.init()``), optimizer parameters missing from ``named_parameters``,
            ``backward_passes_per_step < 1``, ``groups`` / ``num_groups`` that are neither an int
            >= 0 nor lists of parameters (or both given, differently), a predivide factor with an op
            other than Average, an op other than Average, Sum and Adasum, an optimizer that is
            already distributed, or one whose ``step`` an LR scheduler created before wrapping has
            already replaced; a ``process_set`` that is not registered.
        NotImplementedError: ``op=Adasum`` on a process set whose size is not a power of two.
        TypeError: ``compression`` has no ``compress``/``decompress`` methods; ``comm_hook`` is
            not callable; later (from backward()/synchronize()), a hook's ``wait()`` returned
            something else than the bucket's flat tensor.
        ValueError (also): ``comm_hook`` with ``compression``, ``gradient_predivide_factor`` or
            ``op=Adasum``.
        NotInitializedError: before ``gradsync.init()``.
        RuntimeError: later, from ``backward()``, ``synchronize()`` or ``step()``: a gradient
            changed in place or ``p.grad`` replaced while its allreduce was in flight; a backward
            pass after the step's gradients were averaged, without ``step()`` or ``zero_grad()``
            between. The message names the parameter and the fix.
    """
    if named_parameters is not None:
        named_parameters = list(named_parameters)
        check_names(named_parameters, None)  # before anything else, as Horovod (also before init)
    rank = runtime.get().rank
    op, groups = check_arguments(rank, op, gradient_predivide_factor, num_groups, groups, compression,
                                 process_set)
    check_hook(rank, comm_hook, compression, gradient_predivide_factor)
    arguments = Arguments(op, gradient_predivide_factor, groups, compression, bool(sparse_as_dense),
                          process_set, comm_hook, gradient_as_bucket_view)
    return wrap_in_place(optimizer, _DistributedOptimizer, "Distributed",
                         lambda: pick_strategy(arguments, rank), named_parameters,
                         backward_passes_per_step, synchronize_in_backward)
