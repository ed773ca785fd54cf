"""Broadcasting a model's parameters and an optimizer's state from one rank to all."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from .. import ops, runtime
from ..process_sets import ProcessSet, global_process_set


def broadcast_parameters(params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                         root_rank: int = 0, process_set: ProcessSet = global_process_set) -> None:
    """Overwrite every rank's tensors with ``root_rank``'s, in place.

    Call it after building the model (and after loading a checkpoint on the root) so that every rank
    starts from the same weights, as DDP does at construction.

    Args:
        params: ``model.state_dict()`` (parameters and buffers) or ``model.named_parameters()``;
            the same names, shapes and dtypes on every rank. ``None`` values are skipped.
        root_rank: the (world) rank whose values win.
        process_set: the ranks that take part (default: every rank); ``root_rank`` must be one.

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
    handles = [ops.broadcast_async_(tensor.detach(), root_rank, name=f"broadcast.{name}",
                                    process_set=process_set)
               for name, tensor in items if tensor is not None]
    for handle in handles:
        ops.synchronize(handle)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0,
                              process_set: ProcessSet = global_process_set) -> None:
    """Make every rank's optimizer state and hyper-parameters equal to ``root_rank``'s.

    Broadcasts the root's whole ``optimizer.state_dict()`` (per-parameter state such as momentum
    buffers and Adam moments, and every param group's options such as lr, momentum and betas, with
    their Python types) and loads it with ``load_state_dict``. Optimizers whose state is created
    lazily (Adam before its first step) work: ranks simply receive the root's state, empty or not.
    With ``process_set``, only its members take part.

    The root's state is copied to host memory before it is pickled, so GPU state never travels as
    CUDA tensors (which would unpickle onto the root's GPU index on every rank, or fail where a
    rank sees one GPU only); ``load_state_dict`` then moves each value to the device (and dtype)
    of this rank's own parameter, as torch does for any loaded state.

    Raises:
        ValueError: ``root_rank`` out of range (not a member of ``process_set``), or the optimizers'
            parameter groups differ in shape.
    """
    rt = runtime.get()
    if root_rank not in process_set.ranks:
        raise ValueError(f"gradsync: rank {rt.rank}: broadcast_optimizer_state: root_rank="
                         f"{root_rank!r} is not a rank of {process_set}")
    state: Any = _on_host(optimizer.state_dict()) if rt.rank == root_rank else None
    state = ops.broadcast_object(state, root_rank, name="broadcast_optimizer_state",
                                 process_set=process_set)
    if rt.rank != root_rank:
        optimizer.load_state_dict(state)


def _on_host(value: Any) -> Any:
    """``value`` with every tensor outside host memory replaced by a host copy, walking dicts,
    lists and tuples (the containers of a state_dict); the rest is returned as it is."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu() if value.device.type != "cpu" else value
    if isinstance(value, dict):
        return {key: _on_host(item) for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_on_host(item) for item in value)
    return value
