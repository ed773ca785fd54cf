"""What one round of gradient reduction submits, and how it is waited for and checked.

A *round* reduces every parameter of a DistributedOptimizer exactly once: a gradient hook hands a
parameter over as soon as backward has produced its gradient (:meth:`GradientReducer.hand_over`),
and :meth:`GradientReducer.finish_round` hands over the rest (zeros where this rank has no
gradient), waits for all of them, checks that no gradient changed while it was in flight, and
writes the results. So every rank submits the same collectives per round, whatever its data;
*when* each is submitted differs, which negotiation absorbs. When rounds happen is the
optimizer's business (optimizer.py); docs/architecture.md, "Rank-invariant collectives", gives
the rule.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .. import ops
from ..compression import Compressor
from ..fusion import split_rows
from ..process_sets import ProcessSet
from ..protocol import ReduceOp
from .buckets import Bucket, Layout, cut_buckets, is_view
from .collectives import sparse_allreduce_async

DENSE = 1  # layout codes exchanged between ranks; a sparse gradient is DENSE + its sparse_dim


@dataclass(frozen=True)
class Reduction:
    """How gradients are reduced: the DistributedOptimizer arguments that shape the collectives."""

    op: ReduceOp
    prescale: float
    postscale: float
    compression: Compressor
    sparse_as_dense: bool
    process_set: ProcessSet
    comm_hook: Any = None  # None: each gradient allreduced alone; else buckets, reduced by it
    bucket_views: bool = False  # p.grad a view into its bucket's buffer (with comm_hook only)
    bucket_bytes: int = 1 << 20  # a bucket's capacity (the fusion threshold)
    # With comm_hook: only gradients smaller than this (bytes) go into buckets, the others are
    # allreduced alone (the default's small-gradient buckets); 0: every gradient into a bucket.
    bucket_below: int = 0


@dataclass(frozen=True)
class HandedOver:
    """A gradient as it was when its collective started: a later in-place change shows as a larger
    version, a replaced ``p.grad`` as another tensor."""

    grad: torch.Tensor
    version: int


@dataclass
class _Round:
    """One round's collectives: what was handed over, the waits, and what to write afterwards."""

    handed: dict[torch.Tensor, HandedOver] = field(default_factory=dict)
    waits: list[Callable[[], None]] = field(default_factory=list)
    finishes: list[Callable[[], None]] = field(default_factory=list)  # after every wait
    group_ready: dict[int, int] = field(default_factory=dict)  # reduction group -> members handed
    resparsify: dict[torch.Tensor, int] = field(default_factory=dict)  # densified -> sparse_dim
    bucket_ready: dict[int, int] = field(default_factory=dict)  # bucket -> members handed
    bucket_waits: dict[int, Callable[[], None]] = field(default_factory=dict)  # run in bucket order


class GradientReducer:
    """Submits, waits for and checks one optimizer's gradient collectives, round after round.

    Args:
        reduction: the op, scale factors, compression, sparse handling and process set.
        rank: this process's world rank, for messages.

    Parameters are added with :meth:`track`; :meth:`cut_into_groups` cuts those known then into
    reduction groups (``groups``), or, with a communication hook, into buckets
    (:mod:`gradsync.torch.buckets`); parameters tracked later are reduced on their own.
    """

    def __init__(self, reduction: Reduction, rank: int) -> None:
        self.reduction = reduction
        self.rank = rank
        self.names: dict[torch.Tensor, str] = {}  # parameter -> name, in the optimizer's order
        self.groups: dict[torch.Tensor, tuple[int, tuple[torch.Tensor, ...]]] = {}
        self.buckets: dict[torch.Tensor, Layout] = {}  # parameter -> its bucket (with a hook)
        self.layouts: list[Layout] = []
        self.rounds = 0  # rounds finished: every rank counts the same (a bucket's step)
        self._round = _Round()
        self._averaged: dict[torch.Tensor, weakref.ref] = {}  # the gradients the last round wrote
        self._cut = False

    def track(self, param: torch.Tensor, name: str) -> None:
        self.names[param] = name
        if self._cut and self.reduction.comm_hook is not None:
            self._add_buckets([param], [])

    def cut_into_groups(self, groups: int | list) -> None:
        self._cut = True
        self.groups = reduction_groups(list(self.names), groups, self.rank)
        if self.reduction.comm_hook is not None:  # the groups become buckets
            self._add_buckets(list(self.names), list(dict.fromkeys(m for _, m in self.groups.values())))
            self.groups = {}

    def _add_buckets(self, params: list[torch.Tensor], groups: list[tuple[torch.Tensor, ...]]) -> None:
        below = self.reduction.bucket_below
        if below and not groups:  # the larger gradients are allreduced alone (hand_over)
            params = [p for p in params if p.numel() * p.element_size() < below]
        layouts = cut_buckets(params, self.reduction.bucket_bytes, groups, len(self.layouts))
        self.layouts += layouts
        self.buckets.update((param, layout) for layout in layouts for param in layout.params)

    def first_name(self) -> str:
        """The first parameter's name: it tells this optimizer's own collectives apart."""
        return next(iter(self.names.values()), "none")

    def handed(self, param: torch.Tensor) -> bool:
        """True if ``param``'s gradient is part of this round already."""
        return param in self._round.handed

    def in_flight(self) -> list[str]:
        """The names of the gradients handed over in this round, sorted."""
        return sorted(self.names[p] for p in self._round.handed)

    def averaged_by_last_round(self, param: torch.Tensor) -> bool:
        """True if ``param.grad`` is the tensor the last finished round wrote (not dropped since)."""
        ref = self._averaged.get(param)
        return ref is not None and ref() is param.grad

    def hand_over(self, param: torch.Tensor) -> None:
        """Start the collective(s) of ``param.grad`` now (it must not be None)."""
        grad = param.grad
        if grad.layout != torch.strided and self.reduction.sparse_as_dense:
            # The wrapped optimizer gets it sparse again (SparseAdam needs it), as Horovod's.
            self._round.resparsify[param] = grad.sparse_dim()
            param.grad = grad = grad.to_dense()
        self._round.handed[param] = HandedOver(grad, grad._version)
        name = f"grad.{self.names[param]}"
        if grad.layout != torch.strided:
            self._round.waits.append(self._sparse_allgather(param, name, grad))
        if param in self.groups:  # a sparse member counts as ready in its group too
            self._group_member_ready(param)
        elif param in self.buckets:  # and in its bucket (where its slot holds zeros)
            self._bucket_member_ready(param)
        elif grad.layout == torch.strided:
            self._allreduce(param, name, grad)

    def finish_round(self) -> None:
        """Hand over every gradient not handed over yet, wait for the whole round, then write the
        results; the next round starts empty.

        Every rank first tells the others which gradients it has, and their layouts (one small
        allreduce per round, :meth:`_exchange_layouts`). A parameter that no rank has a gradient
        for is not reduced, and its ``p.grad`` stays None, as in one process; for any other one a
        rank without a gradient contributes zeros: dense zeros, or no rows where the others'
        gradients are sparse.

        Raises:
            RuntimeError: a gradient changed in place, or ``p.grad`` was replaced, while its
                collective was in flight (named, with the fix), after the whole round finished.
            CollectiveError, ShutdownError, RankFailureError: a collective failed.
        """
        if not self.names:
            return
        layouts = self._exchange_layouts()
        missing = [p for p in self.names if not self.handed(p)]
        if missing:
            self._hand_over_missing(missing, dict(zip(self.names, ops.synchronize(layouts))))
        else:
            self._round.waits.append(functools.partial(ops.synchronize, layouts))
        done, self._round = self._round, _Round()
        self.rounds += 1
        _call_all(done.waits + [done.bucket_waits[i] for i in sorted(done.bucket_waits)])
        self._check_unchanged(done.handed)
        for finish in done.finishes:
            finish()
        for param, sparse_dim in done.resparsify.items():  # sparse_as_dense, after every write
            param.grad = param.grad.to_sparse(sparse_dim)
        self._averaged = {param: weakref.ref(param.grad) for param in done.handed}

    def _exchange_layouts(self):
        """Start the allreduce (Max) of every parameter's gradient layout on this rank (of the
        gradient handed over, if it was): 0 for none, DENSE, or DENSE + sparse_dim for a sparse
        gradient (joined ranks add nothing)."""
        handed = self._round.handed
        local = np.array([_layout(handed[p].grad if p in handed else p.grad) for p in self.names],
                         np.int8)
        return ops.allreduce_async(local, name=f"gradsync.gradient_layouts.{self.first_name()}",
                                   op=ReduceOp.Max, process_set=self.reduction.process_set)

    def _hand_over_missing(self, missing: list[torch.Tensor], layouts: dict) -> None:
        for param in missing:
            if layouts[param] == 0:  # no rank has a gradient: nothing to reduce
                if param in self.groups:
                    self._group_member_ready(param)
                elif param in self.buckets:
                    self._bucket_member_ready(param)
                continue
            if param.grad is None:
                param.grad = _zeros(param, int(layouts[param]) - DENSE)
            self.hand_over(param)

    def _allreduce(self, param: torch.Tensor, name: str, grad: torch.Tensor) -> None:
        compressed, context = self.reduction.compression.compress(grad)
        reduced = _alias(grad) if compressed is grad else compressed
        handle = ops.allreduce_async_(reduced, name=name, op=self.reduction.op,
                                      prescale_factor=self.reduction.prescale,
                                      postscale_factor=self.reduction.postscale,
                                      process_set=self.reduction.process_set)
        self._round.waits.append(functools.partial(ops.synchronize, handle))
        if compressed is not grad:
            self._round.finishes.append(functools.partial(self._decompress, grad, compressed, context))

    def _decompress(self, grad: torch.Tensor, compressed: torch.Tensor, context) -> None:
        grad.copy_(self.reduction.compression.decompress(compressed, context))

    def _group_member_ready(self, param: torch.Tensor) -> None:
        """Count ``param`` ready in its reduction group; the group's last one starts one grouped
        allreduce per gradient dtype of its dense members."""
        index, members = self.groups[param]
        ready = self._round.group_ready[index] = self._round.group_ready.get(index, 0) + 1
        if ready < len(members):
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for member in members:  # sparse gradients went their own way (allgather)
            grad = member.grad  # None: no rank has one
            if grad is not None and grad.layout == torch.strided:
                compressed, context = self.reduction.compression.compress(grad)
                by_dtype.setdefault(compressed.dtype, []).append(
                    _alias(grad) if compressed is grad else compressed)
                if compressed is not grad:
                    self._round.finishes.append(
                        functools.partial(self._decompress, grad, compressed, context))
        for dtype, grads in by_dtype.items():
            handle = ops.grouped_allreduce_async_(
                grads, name=f"grad.group.{index}.{dtype}", op=self.reduction.op,
                prescale_factor=self.reduction.prescale, postscale_factor=self.reduction.postscale,
                process_set=self.reduction.process_set)
            self._round.waits.append(functools.partial(ops.synchronize, handle))

    def _bucket_member_ready(self, param: torch.Tensor) -> None:
        """Count ``param`` ready in its bucket; the bucket's last one starts the bucket."""
        layout = self.buckets[param]
        ready = self._round.bucket_ready[layout.index] = self._round.bucket_ready.get(layout.index, 0) + 1
        if ready == len(layout.params):
            self._start_bucket(layout)

    def _start_bucket(self, layout: Layout) -> None:
        """Fill the bucket's buffer (nothing to copy where ``p.grad`` is its view already; with
        views, ``p.grad`` becomes the view), then call the hook. The waits of the in-flight check
        are taken now: every member's accumulation into the shared buffer is done."""
        buffer = layout.allocate()
        dense = []
        for param, view in zip(layout.params, layout.views):
            grad = param.grad
            if grad is None or grad.layout != torch.strided:  # none on any rank, or allgathered
                view.zero_()
                continue
            if not is_view(grad, view):
                view.copy_(grad)
                if self.reduction.bucket_views:
                    param.grad = view
            dense.append(param)
        if self.reduction.bucket_views:
            self._round.handed.update((p, HandedOver(p.grad, p.grad._version)) for p in dense)
        bucket = Bucket(layout.index, f"grad.bucket.{self.first_name()}.{layout.index}",
                        tuple(self.names[p] for p in layout.params), _alias(buffer), layout.offsets,
                        tuple(p.shape for p in layout.params), self.reduction.op,
                        self.reduction.process_set, self.rounds)
        future = self.reduction.comm_hook(bucket)
        self._round.bucket_waits[layout.index] = functools.partial(
            self._wait_bucket, layout, bucket, dense, future, self._round.finishes)

    def _wait_bucket(self, layout: Layout, bucket: Bucket, dense: list[torch.Tensor], future,
                     finishes: list[Callable[[], None]]) -> None:
        result = future.wait()
        if (not isinstance(result, torch.Tensor) or result.shape != layout.buffer.shape
                or result.dtype != layout.buffer.dtype):
            got = (f"a {result.dtype} tensor of shape {tuple(result.shape)}"
                   if isinstance(result, torch.Tensor) else repr(type(result)))
            raise TypeError(
                f"gradsync: rank {self.rank}: the comm_hook {self.reduction.comm_hook!r} returned "
                f"{got} from wait() for bucket {bucket.index} ({', '.join(bucket.names[:3])}); "
                f"expected a 1-D {layout.buffer.dtype} tensor of {layout.numel} elements")
        finishes.append(functools.partial(self._write_bucket, layout, dense, result))

    def _write_bucket(self, layout: Layout, dense: list[torch.Tensor], result: torch.Tensor) -> None:
        if result.data_ptr() != layout.buffer.data_ptr():
            layout.buffer.copy_(result)
        if not self.reduction.bucket_views:
            views = dict(zip(layout.params, layout.views))
            for param in dense:
                param.grad.copy_(views[param])

    def _sparse_allgather(self, param: torch.Tensor, name: str,
                          grad: torch.Tensor) -> Callable[[], None]:
        """Start the allgathers of a sparse gradient's indices and values
        (:func:`gradsync.torch.sparse_allreduce_async`); the returned wait finishes them and
        queues setting ``param.grad`` to their coalesced sum over the ranks (divided by the number
        of ranks for Average)."""
        result = sparse_allreduce_async(grad.coalesce(), name, self.reduction.op,
                                        self.reduction.process_set)
        finishes = self._round.finishes

        def wait() -> None:
            summed = result()
            finishes.append(lambda: setattr(param, "grad", summed.coalesce()))

        return wait

    def _check_unchanged(self, handed: dict[torch.Tensor, HandedOver]) -> None:
        replaced = [self.names[p] for p, h in handed.items() if p.grad is not h.grad]
        changed = [self.names[p] for p, h in handed.items()
                   if p.grad is h.grad and h.grad._version != h.version]
        if not (replaced or changed):
            return
        what = (f"was changed in place ({', '.join(map(repr, changed[:3]))})" if changed else
                f"was replaced by another tensor, p.grad = ... ({', '.join(map(repr, replaced[:3]))})")
        raise RuntimeError(
            f"gradsync: rank {self.rank}: the gradient of {len(changed) + len(replaced)} "
            f"parameter(s) {what} while its allreduce was in flight, so the average written back "
            "mixes with that change differently on every rank. Change gradients only once they are "
            "averaged: after backward() returns (or after optimizer.synchronize() with "
            "synchronize_in_backward=False), never in a gradient hook or between backward() and "
            "synchronize().")


def reduction_groups(params: list[torch.Tensor], groups: int | list, rank: int) -> dict:
    """param -> (group index, the group's parameters).

    ``groups`` is an int N: ``params`` in order, cut into N contiguous groups as evenly as possible
    (the first ones one parameter larger; 0: no groups); or a list of lists of parameters: each list
    a group, in its order, without the parameters that are not in ``params`` (no ``requires_grad``).
    Parameters in no group are reduced on their own, as Horovod's singleton groups.

    Raises:
        ValueError: a list entry that is not a list of tensors, or a parameter in two groups.
    """
    if isinstance(groups, int):
        bounds = np.cumsum([0, *split_rows(len(params), groups)]) if groups else [0]
        chunks = [params[a:b] for a, b in zip(bounds, bounds[1:])]
    else:
        _check_groups(groups, rank)
        tracked = {id(p) for p in params}
        chunks = [[p for p in group if id(p) in tracked] for group in groups]
    return {param: (index, tuple(members))
            for index, members in enumerate(chunks) for param in members}


def _check_groups(groups: list, rank: int) -> None:
    """``groups=`` as a list: lists of the optimizer's parameters, each in one group at most."""
    seen: set[int] = set()
    for index, group in enumerate(groups):
        if not isinstance(group, (list, tuple)) or not all(isinstance(p, torch.Tensor) for p in group):
            raise ValueError(f"gradsync: rank {rank}: groups[{index}] must be a list of parameters "
                             f"(torch.Tensor), got {type(group).__qualname__}")
        for p in group:
            if id(p) in seen:
                raise ValueError(f"gradsync: rank {rank}: a parameter of shape {tuple(p.shape)} is in "
                                 "groups twice; a parameter may appear in one group only")
            seen.add(id(p))


def _zeros(param: torch.Tensor, sparse_dim: int) -> torch.Tensor:
    """This rank's contribution for a parameter without a gradient: dense zeros, or an empty
    sparse gradient (no rows) of ``sparse_dim`` sparse dimensions."""
    if sparse_dim == 0:
        return torch.zeros_like(param)
    indices = torch.empty((sparse_dim, 0), dtype=torch.int64, device=param.device)
    values = param.new_empty((0, *param.shape[sparse_dim:]))
    return torch.sparse_coo_tensor(indices, values, param.shape, check_invariants=False)


def _layout(grad: torch.Tensor | None) -> int:
    """0 for no gradient, DENSE, or DENSE + sparse_dim for a sparse one."""
    if grad is None:
        return 0
    return DENSE if grad.layout == torch.strided else DENSE + grad.sparse_dim()


def _alias(grad: torch.Tensor) -> torch.Tensor:
    """The same memory as ``grad`` under a version counter of its own: gradsync's own writes of
    the result (torch ops on the GPU path) must not look like the user changing the gradient."""
    return grad.new_empty(0).set_(grad)


def _call_all(waits: list[Callable[[], None]]) -> None:
    """Call every wait, even after one failed (so that none is left in flight); then raise the
    first error."""
    error = None
    for wait in waits:
        try:
            wait()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            error = error or exc
    if error is not None:
        raise error
