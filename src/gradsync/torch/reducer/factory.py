"""How an optimizer becomes distributed: the argument checks, the choice of the reduction
strategy (:func:`pick_strategy`, the one place that decides it), and the in-place wrap shared by
:func:`gradsync.DistributedOptimizer` and :func:`gradsync.torch.ZeroRedundancyOptimizer`
(:func:`wrap_in_place`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...averaging import predivide_scales
from ...compression import Compression, Compressor
from ...engine.protocol import ReduceOp
from ...executors import adasum
from ...process import runtime
from ...process_sets import ProcessSet
from ..comm_hooks import CommHook, CompressedAllreduce
from .gradients import GradientReducer, Reduction
from .periods import _DistributedOptimizer, distributed_class
from .strategies import (
    AdasumDeltas,
    Buckets,
    BucketViews,
    PerGradient,
    SmallGradientBuckets,
    check_groups,
)

# The capacity of the default's small-gradient buckets: DDP's bucket_cap_mb (25 MB), or the fusion
# threshold if larger. Fewer, larger buckets beat 1 MiB ones for the 291-gradient transformer of
# benchmarks/train_step.py (docs/benchmarks.md); a larger gradient is allreduced alone anyway.
SMALL_GRADIENT_BUCKET_BYTES = 25 << 20


@dataclass(frozen=True)
class Arguments:
    """DistributedOptimizer's arguments that choose the reduction, once checked
    (:func:`check_arguments`): ``op`` a ReduceOp, ``groups`` an int (0: none) or lists."""

    op: ReduceOp
    gradient_predivide_factor: float
    groups: int | list
    compression: Compressor
    sparse_as_dense: bool
    process_set: ProcessSet
    comm_hook: CommHook | None
    gradient_as_bucket_view: bool | None


def pick_strategy(args: Arguments, rank: int) -> GradientReducer:
    """The reduction strategy for these arguments (:mod:`gradsync.torch.reducer.strategies`).

    ``op=Adasum`` (on more than one rank; on one, Average as Horovod): :class:`AdasumDeltas`
    (the one place the Adasum op is told apart). A ``comm_hook`` or
    ``gradient_as_bucket_view=True``: buckets (views unless ``gradient_as_bucket_view=False``;
    without a hook, the default allreduce with ``compression`` and the predivide factor), cut
    from the fusion threshold or the ``groups``. Else, when small-gradient buckets apply
    (:func:`small_gradient_bytes`): :class:`SmallGradientBuckets`. Else :class:`PerGradient`
    (with ``groups``). Depends only on the arguments and the configuration, which every rank
    checks alike at ``init()``.

    Raises:
        NotImplementedError: Adasum on a number of ranks that is not a power of two.
        ValueError: Adasum with a ``comm_hook``.
    """
    prescale, postscale = predivide_scales(args.op, args.gradient_predivide_factor, f"gradsync: rank {rank}")
    op = args.op
    if op == ReduceOp.Adasum and args.process_set.size() == 1:
        op = ReduceOp.Average  # as Horovod: Adasum of one rank's update is that update
    reduction = Reduction(op, prescale, postscale, args.compression, args.sparse_as_dense,
                          args.process_set)
    if op == ReduceOp.Adasum:
        _check_adasum(args, rank)
        return AdasumDeltas(reduction, rank)
    config = runtime.get().config
    views = (args.comm_hook is not None if args.gradient_as_bucket_view is None
             else bool(args.gradient_as_bucket_view))
    if args.comm_hook is not None or views:
        hook = args.comm_hook or CompressedAllreduce(args.compression, prescale, postscale)
        kind = BucketViews if views else Buckets
        return kind(reduction, rank, hook, config.fusion_threshold, args.groups)
    below = small_gradient_bytes(args, config)
    if below:
        return SmallGradientBuckets(reduction, rank, CompressedAllreduce(args.compression, prescale,
                                                                         postscale),
                                    max(config.fusion_threshold, SMALL_GRADIENT_BUCKET_BYTES), below)
    return PerGradient(reduction, rank, args.groups)


def _check_adasum(args: Arguments, rank: int) -> None:
    """Refuse what Adasum cannot do: a number of ranks that is not a power of two (as Horovod's),
    or a communication hook (Adasum combines updates, a hook reduces gradients)."""
    adasum.check_ranks(args.process_set.size(), f"gradsync: rank {rank}: {args.process_set}")
    if args.comm_hook is not None:
        raise ValueError(f"gradsync: rank {rank}: comm_hook={args.comm_hook!r} with op=Adasum: Adasum "
                         "combines the ranks' updates, not their gradients; use one or the other")


def small_gradient_bytes(args: Arguments, config) -> int:
    """The size (bytes) below which the default reduction copies gradients into buckets
    (``GRADSYNC_SMALL_GRADIENT_BYTES``), or 0 where each gradient is allreduced alone:
    ``gradient_as_bucket_view=False`` given, reduction groups (Horovod's ``groups``, which say
    how to fuse), a compression (applied per tensor), or fusion off
    (``GRADSYNC_FUSION_THRESHOLD=0``, which also caps the buckets)."""
    if (args.gradient_as_bucket_view is not None or args.groups
            or args.compression is not Compression.none or config.fusion_threshold <= 0):
        return 0
    return max(0, config.small_gradient_bytes)


def wrap_in_place(optimizer: torch.optim.Optimizer, mixin: type, prefix: str,
                  make_strategy: Callable[[], GradientReducer], named_parameters: list | None,
                  backward_passes_per_step, synchronize_in_backward) -> torch.optim.Optimizer:
    """Make ``optimizer``'s class ``mixin`` + its class (named ``prefix`` + its name), set it up
    with ``make_strategy()`` and the checked names and passes, and return it; a failed setup
    leaves the optimizer as it was.

    Raises:
        ValueError: the optimizer is distributed already, or its ``step`` was replaced on the
            object (an LR scheduler created before wrapping does this); and as
            :func:`check_names` and :func:`check_passes`.
    """
    rank = runtime.get().rank
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError(f"gradsync: rank {rank}: this optimizer is already a DistributedOptimizer "
                         "(or a ZeroRedundancyOptimizer); wrap the plain optimizer once")
    if "step" in vars(optimizer):
        raise ValueError(
            f"gradsync: rank {rank}: optimizer.step has been replaced on this optimizer object (an "
            "LR scheduler created before wrapping does this), so gradients would not be averaged; "
            f"wrap the optimizer with gradsync.{prefix}Optimizer before creating LR schedulers")
    original = type(optimizer)
    optimizer.__class__ = distributed_class(mixin, original, prefix)
    try:
        optimizer._gradsync_setup(check_names(named_parameters, optimizer),
                                  check_passes(backward_passes_per_step), make_strategy(),
                                  bool(synchronize_in_backward))
    except BaseException:
        optimizer.__class__ = original  # a failed wrap leaves the optimizer as it was
        raise
    return optimizer


def check_names(named_parameters, optimizer: torch.optim.Optimizer | None) -> dict:
    """Map parameter -> given name, checking for pairs, duplicate names, and (given
    ``optimizer``) optimizer parameters without a name. Runs also before ``gradsync.init()``
    (the rank in messages is then "?"), as Horovod checks the names first.

    Raises:
        ValueError: not (name, tensor) pairs, duplicate names, or unnamed parameters.
    """
    rank = runtime.get().rank if runtime.is_initialized() else "?"
    if named_parameters is None:
        return {}
    pairs = list(named_parameters)
    if any(not (isinstance(pair, tuple) and len(pair) == 2) for pair in pairs):
        raise ValueError(f"gradsync: rank {rank}: named_parameters must be (name, parameter) pairs, "
                         "as model.named_parameters() gives")
    names = [name for name, _ in pairs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"gradsync: rank {rank}: named_parameters has duplicate names: {duplicates}")
    given = {param: name for name, param in pairs}
    params = [] if optimizer is None else [p for g in optimizer.param_groups for p in g["params"]]
    missing = [i for i, p in enumerate(params) if p not in given]
    if missing:
        raise ValueError(
            f"gradsync: rank {rank}: {len(missing)} optimizer parameter(s) have no name in "
            f"named_parameters (positions {missing[:10]} in the optimizer's parameter list); pass "
            "the named_parameters() of the module that owns every optimized parameter")
    return given


def check_passes(backward_passes_per_step) -> int:
    """``backward_passes_per_step`` as an int >= 1.

    Raises:
        ValueError: it is below 1.
    """
    if int(backward_passes_per_step) < 1:
        raise ValueError(f"gradsync: rank {runtime.get().rank}: backward_passes_per_step must be "
                         f">= 1, got {backward_passes_per_step}")
    return int(backward_passes_per_step)


def check_arguments(rank: int, op, gradient_predivide_factor, num_groups, groups, compression,
                    process_set: ProcessSet) -> tuple[ReduceOp, int | list]:
    """Refuse what DistributedOptimizer cannot do (see its Raises; Adasum's own limits:
    :func:`pick_strategy`); returns the op (a ReduceOp) and the groups (an int, 0 for none, or
    lists)."""
    _check_groups_argument(rank, num_groups, groups)
    op = ReduceOp(op)
    if op not in (ReduceOp.Average, ReduceOp.Sum, ReduceOp.Adasum):
        raise ValueError(f"gradsync: rank {rank}: DistributedOptimizer reduces gradients with "
                         f"Average, Sum or Adasum, got {op.name}")
    predivide_scales(op, gradient_predivide_factor, f"gradsync: rank {rank}: DistributedOptimizer")
    if not (callable(getattr(compression, "compress", None))
            and callable(getattr(compression, "decompress", None))):
        raise TypeError(f"gradsync: rank {rank}: compression={compression!r} needs compress() and "
                        "decompress() methods (see gradsync.Compression)")
    return op, num_groups if groups is None else groups


def _check_groups_argument(rank: int, num_groups, groups) -> None:
    if not _is_count(num_groups):
        raise ValueError(f"gradsync: rank {rank}: num_groups must be an int >= 0 (0: no groups), "
                         f"got {num_groups!r}")
    if groups is not None and not (isinstance(groups, list) or _is_count(groups)):
        raise ValueError(f"gradsync: rank {rank}: groups must be an int >= 0 (0: no groups) or a "
                         f"list of lists of parameters, got {groups!r}")
    if num_groups and groups is not None and groups != num_groups:
        raise ValueError(f"gradsync: rank {rank}: give groups= or num_groups= (its older name), not "
                         f"both: groups={groups!r}, num_groups={num_groups!r}")
    if isinstance(groups, list):
        check_groups(groups, rank)


def check_hook(rank: int, comm_hook, compression, gradient_predivide_factor) -> None:
    """Refuse a ``comm_hook`` that is not callable or comes with what it replaces (with Adasum:
    :func:`pick_strategy`)."""
    if comm_hook is None:
        return
    if not callable(comm_hook):
        raise TypeError(f"gradsync: rank {rank}: comm_hook={comm_hook!r} is not callable; pass a "
                        "function hook(bucket) -> future (see gradsync.allreduce_hook)")
    if compression is not Compression.none or gradient_predivide_factor != 1.0:
        raise ValueError(f"gradsync: rank {rank}: comm_hook={comm_hook!r} reduces the buckets "
                         f"itself; drop compression={compression!r} and gradient_predivide_factor="
                         f"{gradient_predivide_factor} (use gradsync.fp16_compress_hook for fp16)")


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
