"""Gradient buckets: the gradients of several parameters laid out in one flat buffer.

DistributedOptimizer's parameters are cut into *buckets* once, from their order, devices, dtypes
and sizes alone (so every rank cuts them alike), and each bucket owns one persistent flat buffer:
every parameter with ``comm_hook=...`` or ``gradient_as_bucket_view=True``
(:func:`gradsync.DistributedOptimizer`), and by default the parameters whose gradients are small
(below). When every gradient of a bucket has been handed over, the bucket's buffer is reduced by
the communication hook (:mod:`gradsync.torch.comm_hooks`) as one tensor: a lone contiguous
tensor, which the fusion plan reduces in place (no pack, no unpack) once it is larger than the
fusion threshold.

With ``gradient_as_bucket_view=True`` each ``p.grad`` *is* a view into its bucket's buffer, so
autograd accumulates straight into the buffer and the result needs no copy back. A gradient that is
not the view (the first backward after ``zero_grad(set_to_none=True)``, or a ``p.grad`` the user
or an optimizer replaced) is copied into the buffer once and ``p.grad`` re-pointed at the view.
Without views, gradients are copied into the buffer and the result copied back.

By default (no hook, no ``gradient_as_bucket_view``) the same buckets carry the gradients smaller
than ``GRADSYNC_SMALL_GRADIENT_BYTES`` (256 KiB), cut with a capacity of 25 MiB (or the fusion
threshold if larger) and reduced by one allreduce each
(:class:`gradsync.torch.reducer.strategies.SmallGradientBuckets`); larger gradients in host memory
are not in a bucket and are allreduced alone, in place, while on a GPU every gradient is bucketed.

:func:`shard_plan` cuts ZeroRedundancyOptimizer's buckets and splits each evenly by element over
the ranks (a parameter may span owners); each :class:`ShardBucket` is reduce-scattered to its
owners (:mod:`gradsync.torch.zero`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...engine.protocol import ReduceOp
from ...process_sets import ProcessSet

DEFAULT_SHARD_BUCKET_BYTES = 8 << 20  # ZeroRedundancyOptimizer's bucket_bytes


@dataclass(frozen=True)
class Bucket:
    """What a communication hook receives: one bucket's gradients, flat, for one round.

    Attributes:
        index: the bucket's position (0 is the first one backward fills); the same on every rank.
        name: a collective name unique to this bucket of this optimizer, the same on every rank:
            name the hook's collectives after it (``f"{bucket.name}.p"``).
        names: the parameters' names, in the buffer's order.
        buffer: a 1-D contiguous tensor (the gradients' dtype and device) holding every gradient
            back to back; a parameter without a gradient on any rank, or with a sparse gradient
            (reduced apart, by allgather), holds zeros. The hook may reduce it in place.
        offsets: where each gradient starts in ``buffer``, in elements.
        shapes: each gradient's shape.
        op: ``Average`` or ``Sum`` across ``process_set``: what the hook's result must hold.
        process_set: the ranks that reduce this bucket.
        step: rounds this optimizer finished before this one (0 at the first backward); the same
            on every rank, so it may decide what a hook does (PowerSGD's ``start_iter``).
    """

    index: int
    name: str
    names: tuple[str, ...]
    buffer: torch.Tensor
    offsets: tuple[int, ...]
    shapes: tuple[torch.Size, ...]
    op: ReduceOp
    process_set: ProcessSet
    step: int

    def gradients(self) -> list[torch.Tensor]:
        """Each gradient as a view into :attr:`buffer`, in its own shape (writes go to the buffer)."""
        return [_slot(self.buffer, offset, shape) for offset, shape in zip(self.offsets, self.shapes)]


@dataclass
class Layout:
    """One bucket's parameters and where their gradients lie; the buffer and its views are
    allocated at first use and kept (``views[i]`` is the tensor ``params[i].grad`` points at)."""

    index: int
    params: tuple[torch.Tensor, ...]
    offsets: tuple[int, ...]
    numel: int
    buffer: torch.Tensor | None = None
    views: tuple[torch.Tensor, ...] = ()
    host: bool = True  # the buffer is in host memory (set by allocate())

    def allocate(self) -> torch.Tensor:
        if self.buffer is None:
            first = self.params[0]
            self.buffer = torch.zeros(self.numel, dtype=first.dtype, device=first.device)
            self.host = self.buffer.device.type == "cpu"
            self.views = tuple(_slot(self.buffer, o, p.shape)
                               for o, p in zip(self.offsets, self.params))
        return self.buffer


def _slot(buffer: torch.Tensor, offset: int, shape: torch.Size) -> torch.Tensor:
    return buffer[offset:offset + shape.numel()].view(shape)


def is_view(grad: torch.Tensor, view: torch.Tensor) -> bool:
    """True if ``grad`` is the bucket view itself, or a tensor on exactly its memory and layout."""
    return grad is view or (grad.layout == torch.strided and grad.data_ptr() == view.data_ptr()
                            and grad.shape == view.shape and grad.stride() == view.stride()
                            and grad.dtype == view.dtype)


def cut_buckets(params: list[torch.Tensor], capacity: int, groups: list[tuple[torch.Tensor, ...]],
                first_index: int) -> list[Layout]:
    """Cut ``params`` into bucket layouts, in reverse order (the order backward usually produces
    their gradients, as DDP does): each group of ``groups`` (``num_groups``) on its own, or else
    buckets of at most ``capacity`` bytes (a larger parameter alone); within either, one bucket
    per (device, dtype). Depends only on the parameters' order, sizes, dtypes and devices, so
    every rank cuts the same buckets."""
    buckets: list[list[torch.Tensor]] = []
    for chunk in (groups or [tuple(params)]):
        open_bucket: dict[tuple, list[torch.Tensor]] = {}
        for param in reversed(chunk):
            key = (param.device, param.dtype)
            size = param.numel() * param.element_size()
            members = open_bucket.get(key)
            if members is not None and (groups or _bytes(members) + size <= capacity):
                members.append(param)
                continue
            members = [param]
            buckets.append(members)
            if groups or size <= capacity:
                open_bucket[key] = members
            else:
                open_bucket.pop(key, None)
    return [_layout(first_index + i, members) for i, members in enumerate(buckets)]


def _bytes(members: list[torch.Tensor]) -> int:
    return sum(p.numel() * p.element_size() for p in members)


def _layout(index: int, members: list[torch.Tensor]) -> Layout:
    offsets, position = [], 0
    for param in members:
        offsets.append(position)
        position += param.numel()
    return Layout(index, tuple(members), tuple(offsets), position)


@dataclass(frozen=True)
class Piece:
    """The elements of one parameter that one rank owns: the parameter's flat elements ``start``
    to ``start + numel``, at ``row_start`` in that rank's row of bucket ``bucket``."""

    param: torch.Tensor
    bucket: int
    start: int
    numel: int
    row_start: int

    @property
    def whole(self) -> bool:
        """True if the rank owns every element of the parameter."""
        return self.numel == self.param.numel()


@dataclass(frozen=True)
class ShardBucket:
    """ZeroRedundancyOptimizer's bucket: parameters of one (device, dtype) laid out flat, back to
    back (``offsets``, ``numel`` elements in all), and split evenly by element: rank r owns the
    bucket's elements ``r * width`` to ``min((r + 1) * width, numel)``, so the buffer reduce-scattered
    is ``(ranks, width)`` with row r holding rank r's elements (zero padding at the end of the last)."""

    index: int
    members: tuple[torch.Tensor, ...]
    offsets: tuple[int, ...]
    numel: int
    width: int  # elements per row: ceil(numel / ranks)

    def pieces(self, rank: int) -> list[Piece]:
        """The pieces of the members that ``rank`` (index in the process set) owns, in order."""
        first, end = rank * self.width, min((rank + 1) * self.width, self.numel)
        pieces = []
        for param, offset in zip(self.members, self.offsets):
            lo, hi = max(offset, first), min(offset + param.numel(), end)
            if lo < hi:
                pieces.append(Piece(param, self.index, lo - offset, hi - lo, lo - first))
        return pieces


@dataclass(frozen=True)
class ShardPlan:
    """The buckets, each split evenly over ``size`` ranks; the same on every rank."""

    buckets: tuple[ShardBucket, ...]
    size: int

    def pieces(self, rank: int) -> dict:
        """parameter -> the :class:`Piece` of it that ``rank`` owns (at most one per parameter:
        a rank's elements of a bucket are contiguous); parameters it owns nothing of are absent."""
        return {piece.param: piece for bucket in self.buckets for piece in bucket.pieces(rank)}

    def elements(self, rank: int) -> int:
        """How many parameter elements ``rank`` owns (at most ceil(total / size) + one per bucket)."""
        return sum(piece.numel for piece in self.pieces(rank).values())

    def padding(self) -> float:
        """Padding elements over gradient elements, in all buckets (under ``size`` per bucket)."""
        used = sum(b.numel for b in self.buckets)
        return (sum(b.width for b in self.buckets) * self.size - used) / max(used, 1)


def shard_plan(params: list[torch.Tensor], size: int,
               bucket_bytes: int = DEFAULT_SHARD_BUCKET_BYTES) -> ShardPlan:
    """Cut ``params`` (in the optimizer's order) into buckets, each split evenly over ``size`` ranks.

    The parameters are laid out flat in reverse order (the order backward produces gradients, as
    DDP's buckets), per (device, dtype); a bucket closes once it holds at least ``bucket_bytes``
    (a larger parameter makes a bucket of its own). Each bucket's elements are then split into
    ``size`` contiguous ranges of ``ceil(numel / size)`` (DeepSpeed's ZeRO-1 partition, per bucket),
    so a parameter may span owners, and every rank owns at most ``ceil(total / size)`` elements
    plus one per bucket, on any model. Depends only on shapes, dtypes, devices and order, so every
    rank computes the same plan.
    """
    open_buckets: dict[tuple, list[torch.Tensor]] = {}  # (device, dtype) -> members
    elements: dict[tuple, int] = {}
    closed: list[list[torch.Tensor]] = []
    for param in reversed(params):
        key = (param.device, param.dtype)
        open_buckets.setdefault(key, []).append(param)
        elements[key] = elements.get(key, 0) + param.numel()
        if elements[key] * param.element_size() >= bucket_bytes:
            closed.append(open_buckets.pop(key))
            del elements[key]
    closed.extend(open_buckets.values())
    return ShardPlan(tuple(_shard_bucket(i, members, size) for i, members in enumerate(closed)), size)


def _shard_bucket(index: int, members: list[torch.Tensor], size: int) -> ShardBucket:
    layout = _layout(index, members)
    return ShardBucket(index, layout.params, layout.offsets, layout.numel, -(-layout.numel // size))
