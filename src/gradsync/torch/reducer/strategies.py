"""The reduction strategies of DistributedOptimizer: which collectives carry the gradients.

:func:`gradsync.torch.reducer.factory.pick_strategy` picks one per optimizer, once, from its arguments;
the optimizer (:mod:`gradsync.torch.reducer.periods`) then only decides *when* a round starts and ends.
Every strategy keeps :class:`gradsync.torch.reducer.gradients.GradientReducer`'s contract (the round, the
layout exchange, sparse gradients allgathered, the in-flight check); each says below what carries a
dense gradient and which hooks it registers:

* :class:`PerGradient`: each gradient allreduced alone, or Horovod's reduction ``groups``;
* :class:`SmallGradientBuckets`: the default; gradients below ``GRADSYNC_SMALL_GRADIENT_BYTES``
  (and every gradient on a GPU) copied into buckets, the larger ones allreduced alone;
* :class:`Buckets`: every gradient copied into a bucket that a communication hook reduces;
* :class:`BucketViews`: the same, with ``p.grad`` a view into its bucket (no copies);
* :class:`AdasumDeltas`: no gradient reduced; ``step()`` combines the updates by Adasum;
* :class:`gradsync.torch.zero.ShardReducer`: ZeRO's reduce-scatter to the owners of the shards.

Which collectives a strategy submits depends only on the parameters' order, sizes, dtypes and
devices and on the arguments, never on a rank's data (docs/architecture.md, "Rank-invariant
collectives").
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ... import ops
from ...engine.protocol import ReduceOp, split_rows
from ..comm_hooks import CommHook
from .buckets import Bucket, Layout, cut_buckets, is_view
from .gradients import GradientReducer, HandedOver, Reduction, alias

STAGE_BATCH = 16  # host gradients copied into their bucket together, as they are handed over


class PerGradient(GradientReducer):
    """Each dense gradient allreduced alone, in place, as soon as its hook hands it over (the
    fusion buffer joins those that are ready together). With ``groups`` (Horovod's: an int N, or
    lists of parameters; :func:`reduction_groups`), the members of a group are reduced by one
    grouped allreduce per gradient dtype once all are ready; parameters attached after
    :meth:`plan` are reduced alone. Registers one post-accumulate-grad hook per parameter."""

    def __init__(self, reduction: Reduction, rank: int, groups: int | list = 0) -> None:
        super().__init__(reduction, rank)
        self.groups_argument = groups
        self.groups: dict[torch.Tensor, tuple[int, tuple[torch.Tensor, ...]]] = {}

    def plan(self) -> None:
        self.groups = reduction_groups(list(self.names), self.groups_argument)

    def _ready(self, param: torch.Tensor, grad: torch.Tensor | None) -> None:
        group = self.groups.get(param) if self.groups else None  # no tensor hash without groups
        if group is None:
            if grad is not None and grad.layout == torch.strided:  # else sparse, or none anywhere
                self._allreduce(f"grad.{self.names[param]}", grad)
        elif self._count_ready(group[0], len(group[1])):  # a sparse member counts as ready too
            self._start_group(*group)

    def _start_group(self, index: int, members: tuple[torch.Tensor, ...]) -> None:
        """One grouped allreduce per gradient dtype of the group's dense members."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for member in members:  # sparse gradients went their own way (allgather)
            grad = member.grad  # None: no rank has one
            if grad is not None and grad.layout == torch.strided:
                reduced = self._compress(grad)
                by_dtype.setdefault(reduced.dtype, []).append(reduced)
        for dtype, grads in by_dtype.items():
            handle = ops.grouped_allreduce_async_(
                grads, name=f"grad.group.{index}.{dtype}", op=self.reduction.op,
                prescale_factor=self.reduction.prescale, postscale_factor=self.reduction.postscale,
                process_set=self.reduction.process_set)
            self._round.waits.append(functools.partial(ops.synchronize, handle))


class Buckets(PerGradient):
    """Every dense gradient copied into its bucket (:mod:`gradsync.torch.reducer.buckets`: cut in reverse
    order per (device, dtype) up to ``capacity`` bytes, or one bucket per reduction group); the
    bucket's last gradient starts ``hook(bucket)`` (:mod:`gradsync.torch.comm_hooks`); the
    round's end waits for the hooks in bucket order and copies the results back. Parameters
    attached after :meth:`plan` get buckets of their own. Registers one hook per parameter.

    Raises (from the round's end): TypeError if a hook's ``wait()`` returns anything but a tensor
    of the bucket buffer's shape and dtype."""

    def __init__(self, reduction: Reduction, rank: int, hook: CommHook, capacity: int,
                 groups: int | list = 0) -> None:
        super().__init__(reduction, rank, groups)
        self.hook = hook
        self.capacity = capacity
        self.buckets: dict[torch.Tensor, tuple[Layout, int]] = {}  # parameter -> bucket, position
        self.layouts: list[Layout] = []
        self._members: dict[int, tuple[tuple[str, ...], tuple[torch.Size, ...]]] = {}  # names, shapes
        self._planned = False

    def attach(self, param: torch.Tensor, name: str, on_gradient: Callable[[torch.Tensor], None]) -> None:
        super().attach(param, name, on_gradient)
        if self._planned:
            self._add_buckets([param], [])

    def plan(self) -> None:
        super().plan()  # the groups become buckets
        self._add_buckets(list(self.names), list(dict.fromkeys(m for _, m in self.groups.values())))
        self.groups = {}
        self._planned = True

    def _add_buckets(self, params: list[torch.Tensor], groups: list[tuple[torch.Tensor, ...]]) -> None:
        layouts = cut_buckets(params, self.capacity, groups, len(self.layouts))
        self.layouts += layouts
        self.buckets.update((param, (layout, i)) for layout in layouts
                            for i, param in enumerate(layout.params))
        # What each round's Bucket says of its members, worked out once (not per gradient per round).
        self._members.update((layout.index, (tuple(self.names[p] for p in layout.params),
                                             tuple(p.shape for p in layout.params)))
                             for layout in layouts)

    def _ready(self, param: torch.Tensor, grad: torch.Tensor | None) -> None:
        slot = self.buckets.get(param)
        if slot is None:  # allreduced alone
            if grad is not None and grad.layout == torch.strided:
                self._allreduce(f"grad.{self.names[param]}", grad)
            return
        layout, position = slot
        if grad is not None and grad.layout == torch.strided:
            self._stage(layout, position, param, grad)
        if self._count_ready(layout.index, len(layout.params)):  # sparse: its slot holds zeros
            self._start_bucket(layout)

    def _stage(self, layout: Layout, position: int, param: torch.Tensor, grad: torch.Tensor) -> None:
        """Note a dense gradient for its bucket. In host memory it is copied into its slot now:
        backward has just written it, so it is still in cache, and the bucket's start (on the
        critical path when its last member is backward's last gradient) copies nothing. On a GPU
        the bucket's start copies them all in one foreach copy (:meth:`_fill`), one launch
        rather than one per gradient."""
        if layout.buffer is None:
            layout.allocate()
        staged = self._round.staged
        members = staged.get(layout.index)
        if members is None:
            members = staged[layout.index] = []
        members.append((param, layout.views[position]))
        if layout.host and len(members) % STAGE_BATCH == 0:
            _copy_in(members[-STAGE_BATCH:])

    def _start_bucket(self, layout: Layout) -> None:
        """Fill the rest of the bucket's buffer, then call the hook; its wait runs at the round's end."""
        buffer = layout.allocate()
        dense = self._fill(layout)
        names, shapes = self._members[layout.index]
        bucket = Bucket(layout.index, f"grad.bucket.{self.first_name()}.{layout.index}", names,
                        alias(buffer), layout.offsets, shapes, self.reduction.op,
                        self.reduction.process_set, self.rounds)
        future = self.hook(bucket)
        self._round.bucket_waits[layout.index] = functools.partial(
            self._wait_bucket, _InFlight(layout, bucket, dense, future), self._round.finishes)

    def _fill(self, layout: Layout) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Zero the slots of the members without a dense gradient (none on any rank, or sparse:
        allgathered) and copy in the dense ones not copied yet (:meth:`_stage`: the last batch,
        or all of them on a GPU). Returns (member, its slot) for the members with a dense
        gradient, in hand-over order."""
        dense = self._round.staged.pop(layout.index, [])
        rest = dense if not layout.host else dense[len(dense) - len(dense) % STAGE_BATCH:]
        if rest:
            _copy_in(rest)
        if len(dense) < len(layout.params):
            copied = {id(view) for _, view in dense}
            for view in layout.views:
                if id(view) not in copied:
                    view.zero_()
        return dense

    def _wait_bucket(self, flight: _InFlight, finishes: list[Callable[[], None]]) -> None:
        result = flight.future.wait()
        layout, bucket = flight.layout, flight.bucket
        if (not isinstance(result, torch.Tensor) or result.shape != layout.buffer.shape
                or result.dtype != layout.buffer.dtype):
            got = (f"a {result.dtype} tensor of shape {tuple(result.shape)}"
                   if isinstance(result, torch.Tensor) else repr(type(result)))
            raise TypeError(
                f"gradsync: rank {self.rank}: the comm_hook {self.hook!r} returned "
                f"{got} from wait() for bucket {bucket.index} ({', '.join(bucket.names[:3])}); "
                f"expected a 1-D {layout.buffer.dtype} tensor of {layout.numel} elements")
        finishes.append(functools.partial(self._write_bucket, layout, flight.dense, result))

    def _write_bucket(self, layout: Layout, dense: list[tuple[torch.Tensor, torch.Tensor]],
                      result: torch.Tensor) -> None:
        if result.data_ptr() != layout.buffer.data_ptr():
            layout.buffer.copy_(result)
        self._copy_out(dense)

    def _copy_out(self, dense: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy each (member, slot)'s result back into its gradient, in one foreach copy."""
        if dense:
            torch._foreach_copy_([param.grad for param, _ in dense], [view for _, view in dense])


class BucketViews(Buckets):
    """As :class:`Buckets`, with each ``p.grad`` a view into its bucket's buffer (DDP's
    ``gradient_as_bucket_view``): autograd accumulates straight into the buffer, the hook reduces
    it in place, and nothing is copied back. A gradient that is not the view (after
    ``zero_grad(set_to_none=True)``, or a replaced ``p.grad``) is copied in once and ``p.grad``
    re-pointed at the view; the in-flight check then watches the views."""

    def _stage(self, layout: Layout, position: int, param: torch.Tensor, grad: torch.Tensor) -> None:
        """Nothing yet: the bucket's start copies in what is not a view already (:meth:`_fill`)."""

    def _fill(self, layout: Layout) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Zero the slots of the members without a dense gradient; copy in the dense gradients
        that are not their slot's view (none when autograd accumulated into the views: one
        foreach copy of the others), and re-point their ``p.grad`` at the view; the in-flight
        check then watches the views. Returns (member, slot) for the dense ones, in bucket order."""
        dense = []
        for param, view in zip(layout.params, layout.views):
            grad = param.grad
            if grad is None or grad.layout != torch.strided:  # none on any rank, or allgathered
                view.zero_()
            else:
                dense.append((param, view))
        copies = [(param, view) for param, view in dense if not is_view(param.grad, view)]
        if copies:
            _copy_in(copies)
        for param, view in copies:
            param.grad = view
        self._round.handed.update((p, HandedOver(p.grad, p.grad._version)) for p, _ in dense)
        return dense

    def _copy_out(self, dense: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Nothing: the gradients are the buffer's views."""


class SmallGradientBuckets(Buckets):
    """The default: gradients smaller than ``below`` bytes (``GRADSYNC_SMALL_GRADIENT_BYTES``),
    and every gradient on a GPU, are copied into buckets of up to ``capacity`` bytes that one
    allreduce each reduces (``hook``: :class:`~gradsync.torch.comm_hooks.CompressedAllreduce`
    with the optimizer's scale factors), and the results copied back; larger host gradients are
    allreduced alone, in place. The same numbers as :class:`PerGradient`, fewer collectives.

    On a GPU a bucket's copies cost microseconds (one foreach copy in, one out, at device memory
    bandwidth) while each collective costs the host a negotiation, a submission and stream
    events, so every gradient is bucketed, as DDP's reducer does (docs/gpu.md). In host memory a
    copy of a large gradient costs more than its collective saves
    (docs/performance-notes.md, fact 4). Which parameters are bucketed depends on their devices,
    sizes and order, the same on every rank."""

    def __init__(self, reduction: Reduction, rank: int, hook: CommHook, capacity: int,
                 below: int) -> None:
        super().__init__(reduction, rank, hook, capacity)
        self.below = below

    def _add_buckets(self, params: list[torch.Tensor], groups: list[tuple[torch.Tensor, ...]]) -> None:
        small = [p for p in params if p.is_cuda or p.numel() * p.element_size() < self.below]
        super()._add_buckets(small, groups)


class AdasumDeltas(GradientReducer):
    """Horovod's Adasum optimizer: no gradient is reduced (no hooks; gradients accumulate
    locally), and :meth:`step` combines the wrapped optimizer's *updates* by Adasum."""

    averages_gradients = False

    def attach(self, param: torch.Tensor, name: str, on_gradient: Callable[[torch.Tensor], None]) -> None:
        self.names[param] = name

    def allow_skip_synchronize(self) -> None:
        raise AssertionError("gradsync: skip_synchronize() has no meaning with op=Adasum: step() "
                             "reduces the wrapped optimizer's update itself; call step() alone")

    def step(self, run_step: Callable, closure: Callable | None):
        """The wrapped optimizer steps on this rank's own (locally accumulated) gradients, and
        closure losses stay this rank's own; the update of every parameter (its change, learning
        rate and momentum included) is combined across ranks by Adasum, and every rank applies the
        combined update to its parameters as they were before the step. One grouped Adasum
        allreduce per dtype (after ``compression``), on host memory (CUDA tensors are staged);
        every rank submits them whatever its gradients (a parameter without one has a zero
        update)."""
        from ..collectives import grouped_allreduce_async_

        params = list(self.names)
        with torch.no_grad():
            start = [p.detach().clone() for p in params]
        loss = run_step(closure)
        compression = self.reduction.compression
        by_dtype: dict[torch.dtype, list[_AdasumUpdate]] = {}
        with torch.no_grad():
            for param, before in zip(params, start):
                param.sub_(before)  # the update, reduced in the parameter's own memory
                compressed, context = compression.compress(param.detach())
                by_dtype.setdefault(compressed.dtype, []).append(
                    _AdasumUpdate(param, compressed, context, before))
            handles = [grouped_allreduce_async_([u.compressed for u in updates], op=ReduceOp.Adasum,
                                                name=f"adasum.{self.first_name()}.{dtype}",
                                                process_set=self.reduction.process_set)
                       for dtype, updates in by_dtype.items()]
            for handle in handles:
                ops.synchronize(handle)
            for update in (u for updates in by_dtype.values() for u in updates):
                update.param.copy_(update.before + compression.decompress(update.compressed,
                                                                          update.context))
        return loss


@dataclass(frozen=True)
class _AdasumUpdate:
    """One parameter's update in an Adasum step: reduced in ``compressed``, added to ``before``."""

    param: torch.Tensor
    compressed: torch.Tensor
    context: object
    before: torch.Tensor


def _copy_in(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each (member, slot)'s gradient into the slot: one foreach copy, not one op each."""
    torch._foreach_copy_([view for _, view in pairs], [param.grad for param, _ in pairs])


@dataclass(frozen=True)
class _InFlight:
    """A bucket whose hook is running: its layout, what the hook got, (member, slot) for the
    members with a dense gradient, and the hook's future."""

    layout: Layout
    bucket: Bucket
    dense: list
    future: object


def reduction_groups(params: list[torch.Tensor], groups: int | list) -> dict:
    """param -> (group index, the group's parameters).

    ``groups`` is an int N: ``params`` in order, cut into N contiguous groups as evenly as possible
    (the first ones one parameter larger; 0: no groups); or a list of lists of parameters (checked
    by :func:`check_groups`): each list a group, in its order, without the parameters that are not
    in ``params`` (no ``requires_grad``). Parameters in no group are reduced on their own, as
    Horovod's singleton groups.
    """
    if isinstance(groups, int):
        bounds = np.cumsum([0, *split_rows(len(params), groups)]) if groups else [0]
        chunks = [params[a:b] for a, b in zip(bounds, bounds[1:])]
    else:
        tracked = {id(p) for p in params}
        chunks = [[p for p in group if id(p) in tracked] for group in groups]
    return {param: (index, tuple(members))
            for index, members in enumerate(chunks) for param in members}


def check_groups(groups: list, rank: int) -> None:
    """``groups=`` as a list: lists of the optimizer's parameters, each in one group at most.

    Raises:
        ValueError: a list entry that is not a list of tensors, or a parameter in two groups.
    """
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
