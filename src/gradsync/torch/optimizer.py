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
                         compression: Compressor = Compression.none, backward_passes_per_step: int = 1,
                         op: ReduceOp = ReduceOp.Average, gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0, groups: int | list[list[torch.Tensor]] | None = None,
                         sparse_as_dense: bool = False, process_set: ProcessSet = global_process_set,
                         synchronize_in_backward: bool = True, comm_hook: CommHook | None = None,
                         gradient_as_bucket_view: bool | None = None) -> torch.optim.Optimizer:
    """Make ``optimizer`` data-parallel: gradients are averaged across ranks while backward runs.

    Each gradient is allreduced as soon as backward produces it; backward returns the averages;
    wrapped in place. Long form, ``pick_strategy``'s rule: docs/api.md, "DistributedOptimizer in detail".

    Args:
        optimizer: a ``torch.optim.Optimizer`` over CPU or CUDA parameters (one GPU per rank).
        named_parameters: ``model.named_parameters()``: names identify gradients across ranks.
        compression: ``Compression.none``/``.fp16``/``.bf16``, or a ``Compressor``.
        backward_passes_per_step: int >= 1, backward passes summed locally per allreduce.
        op: ``Average`` (default), ``Sum``, or ``Adasum`` (the updates are combined instead).
        gradient_predivide_factor: float f, Average only: x 1/f before the sum, f/size after.
        num_groups: int, as ``groups=N`` (Horovod's older name).
        groups: an int N (N even groups) or lists of parameters, reduced by grouped allreduces.
        sparse_as_dense: bool, densify sparse gradients instead of allgathering them.
        process_set: the ranks that average (Average divides by its size).
        synchronize_in_backward: bool; False: Horovod's timing, ``step()`` waits instead.
        comm_hook: ``hook(bucket)`` reducing each bucket's flat buffer (docs/comm-hooks.md).
        gradient_as_bucket_view: bool or None (True with a hook): ``p.grad`` views its bucket.

    Raises:
        ValueError: arguments that contradict each other or the optimizer, named in the message.
        TypeError: a compressor without ``compress``/``decompress``, or a hook not callable.
        NotImplementedError: ``op=Adasum`` on a set whose size is not a power of two.
        NotInitializedError: before ``gradsync.init()``.

    Example::

        opt = gradsync.DistributedOptimizer(opt, named_parameters=model.named_parameters())
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
