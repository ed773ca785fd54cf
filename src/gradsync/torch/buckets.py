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
(:class:`gradsync.torch.strategies.SmallGradientBuckets`); larger gradients are not in a bucket
and are allreduced alone, in place.

:func:`shard_plan` cuts ZeroRedundancyOptimizer's buckets: each parameter gets an owner rank, and
each :class:`ShardBucket` is reduce-scattered to the owners (:mod:`gradsync.torch.zero`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..process_sets import ProcessSet
from ..protocol import ReduceOp

DEFAULT_SHARD_BUCKET_BYTES = 8 << 20  # ZeroRedundancyOptimizer's bucket_bytes
BALANCE_SLACK = 0.05  # a shard bucket closes once its padding is at most this fraction of its elements


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

    def allocate(self) -> torch.Tensor:
        if self.buffer is None:
            first = self.params[0]
            self.buffer = torch.zeros(self.numel, dtype=first.dtype, device=first.device)
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
class Slot:
    """Where one parameter's gradient sits in its bucket's buffer: row ``owner``, elements
    ``start`` to ``start + numel``."""

    param: torch.Tensor
    owner: int  # index of the owning rank in the process set
    start: int
    numel: int


@dataclass(frozen=True)
class ShardBucket:
    """ZeroRedundancyOptimizer's bucket: parameters reduce-scattered together, one buffer of
    ``(ranks, width)`` elements."""

    index: int
    slots: tuple[Slot, ...]
    width: int  # elements per row: the longest owner's share

    @property
    def members(self) -> tuple[torch.Tensor, ...]:
        return tuple(slot.param for slot in self.slots)


@dataclass(frozen=True)
class ShardPlan:
    """Which rank owns which parameter, and the buckets; the same on every rank."""

    buckets: tuple[ShardBucket, ...]
    owner: dict  # parameter -> owner index in the process set
    size: int

    def padding(self) -> float:
        """Padding elements over gradient elements, in all buckets (0.0: none)."""
        used = sum(slot.numel for b in self.buckets for slot in b.slots)
        return (sum(b.width for b in self.buckets) * self.size - used) / max(used, 1)


def shard_plan(params: list[torch.Tensor], size: int,
               bucket_bytes: int = DEFAULT_SHARD_BUCKET_BYTES) -> ShardPlan:
    """Cut ``params`` (in the optimizer's order) into buckets and give each parameter an owner.

    Buckets are filled in reverse order (the order backward produces gradients, as DDP's), per
    (device, dtype). Within a bucket the parameters go, largest first, each to the rank with the
    fewest elements in the bucket so far (ties: the fewest elements over all buckets, then the
    lowest rank); a bucket closes once it holds at least ``bucket_bytes`` and its rows differ by at
    most 5 % (or once it holds twice ``bucket_bytes``). Depends only on shapes, dtypes, devices and
    order, so every rank computes the same plan.
    """
    totals = [0] * size
    owner: dict = {}
    open_buckets: dict[tuple, list[torch.Tensor]] = {}  # (device, dtype) -> members
    closed: list[list[torch.Tensor]] = []
    for param in reversed(params):
        key = (param.device, param.dtype)
        members = open_buckets.setdefault(key, [])
        members.append(param)
        elements = sum(p.numel() for p in members)
        if elements * param.element_size() < bucket_bytes:
            continue
        owners, loads = _assign_owners(members, totals)
        padding = max(loads) * size - elements
        if padding <= BALANCE_SLACK * elements or elements * param.element_size() >= 2 * bucket_bytes:
            _close_shard_bucket(members, owners, totals, owner, closed)
            del open_buckets[key]
    for members in open_buckets.values():
        _close_shard_bucket(members, _assign_owners(members, totals)[0], totals, owner, closed)
    return ShardPlan(tuple(_shard_bucket(i, m, owner, size) for i, m in enumerate(closed)), owner, size)


def _assign_owners(members: list[torch.Tensor], totals: list[int]) -> tuple[list[int], list[int]]:
    """Each member's owner (largest first to the least loaded rank) and the ranks' loads."""
    loads = [0] * len(totals)
    owners = [0] * len(members)
    for i in sorted(range(len(members)), key=lambda i: (-members[i].numel(), i)):
        rank = min(range(len(totals)), key=lambda r: (loads[r], totals[r], r))
        owners[i] = rank
        loads[rank] += members[i].numel()
    return owners, loads


def _close_shard_bucket(members: list[torch.Tensor], owners: list[int], totals: list[int], owner: dict,
           closed: list) -> None:
    for param, rank in zip(members, owners):
        owner[param] = rank
        totals[rank] += param.numel()
    closed.append(members)


def _shard_bucket(index: int, members: list[torch.Tensor], owner: dict, size: int) -> ShardBucket:
    starts = [0] * size
    slots = []
    for param in members:
        r = owner[param]
        slots.append(Slot(param, r, starts[r], param.numel()))
        starts[r] += param.numel()
    return ShardBucket(index, tuple(slots), max(starts))
