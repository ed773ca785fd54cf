"""Gradient buckets: the gradients of several parameters laid out in one flat buffer.

With ``comm_hook=...`` or ``gradient_as_bucket_view=True`` (:func:`gradsync.DistributedOptimizer`)
the parameters are cut into *buckets* once, from their order, devices, dtypes and sizes alone (so
every rank cuts them alike), and each bucket owns one persistent flat buffer. When every gradient
of a bucket has been handed over, the bucket's buffer is reduced by the communication hook
(:mod:`gradsync.torch.comm_hooks`) as one tensor: a lone contiguous tensor, which the fusion plan
reduces in place (no pack, no unpack) once it is larger than the fusion threshold.

With ``gradient_as_bucket_view=True`` each ``p.grad`` *is* a view into its bucket's buffer, so
autograd accumulates straight into the buffer and the result needs no copy back. A gradient that is
not the view (the first backward after ``zero_grad(set_to_none=True)``, or a ``p.grad`` the user
or an optimizer replaced) is copied into the buffer once and ``p.grad`` re-pointed at the view.
Without views, gradients are copied into the buffer and the result copied back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..process_sets import ProcessSet
from ..protocol import ReduceOp


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
