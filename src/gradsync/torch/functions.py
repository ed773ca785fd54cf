"""Broadcasting a model's parameters and an optimizer's state from one rank to all."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from .. import ops, runtime


def broadcast_parameters(params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                         root_rank: int = 0) -> None:
    """Overwrite every rank's tensors with ``root_rank``'s, in place.

    Call it after building the model (and after loading a checkpoint on the root) so that every rank
    starts from the same weights, as DDP does at construction.

    Args:
        params: ``model.state_dict()`` (parameters and buffers) or ``model.named_parameters()``;
            the same names, shapes and dtypes on every rank. ``None`` values are skipped.
        root_rank: the rank whose values win.

    Raises:
        TypeError: ``params`` is neither a mapping nor an iterable of (name, tensor) pairs.
        ValueError: ``root_rank`` out of range. CollectiveError: shapes or dtypes differ by rank.
    """
    if isinstance(params, Mapping):
        items = list(params.items())
    else:
        items = list(params)
        if any(not (isinstance(i, tuple) and len(i) == 2) for i in items):
            raise TypeError("gradsync.broadcast_parameters: expected model.state_dict() or "
                            "model.named_parameters() (pairs of name and tensor)")
    handles = [ops.broadcast_async_(tensor.detach(), root_rank, name=f"broadcast.{name}")
               for name, tensor in items if tensor is not None]
    for handle in handles:
        ops.synchronize(handle)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Make every rank's optimizer state and hyper-parameters equal to ``root_rank``'s.

    Broadcasts the root's whole ``optimizer.state_dict()`` (per-parameter state such as momentum
    buffers and Adam moments, and every param group's options such as lr, momentum and betas, with
    their Python types) and loads it with ``load_state_dict``. Optimizers whose state is created
    lazily (Adam before its first step) work: ranks simply receive the root's state, empty or not.

    Raises:
        ValueError: ``root_rank`` out of range, or the optimizers' parameter groups differ in shape.
    """
    rt = runtime.get()
    if not 0 <= root_rank < rt.size:
        raise ValueError(f"gradsync: rank {rt.rank}: broadcast_optimizer_state: root_rank="
                         f"{root_rank!r} is not a rank of this job (0 .. {rt.size - 1})")
    state: Any = optimizer.state_dict() if rt.rank == root_rank else None
    state = ops.broadcast_object(state, root_rank, name="broadcast_optimizer_state")
    if rt.rank != root_rank:
        optimizer.load_state_dict(state)
