"""Broadcasting a model's parameters and an optimizer's state from one rank to all, and objects.

Horovod's ``horovod.torch.functions``: :func:`broadcast_parameters`, :func:`broadcast_optimizer_state`,
:func:`broadcast_object` and :func:`allgather_object`, with Horovod's argument order (gradsync adds
``process_set`` as the last argument of the first two).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from .. import naming, ops
from ..ops import allgather_object, broadcast_object
from ..process import runtime
from ..process_sets import ProcessSet, global_process_set

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object",
           "allgather_object"]


class ParametersTypeError(TypeError, ValueError):
    """``params`` of :func:`broadcast_parameters` is of no accepted kind (a ValueError in Horovod)."""


def _named(params: Any) -> list[tuple[str | None, torch.Tensor]]:
    """(name, tensor) pairs of a state_dict, of named_parameters() or of plain tensors (None name)."""
    if isinstance(params, Mapping):
        return sorted(params.items(), key=lambda item: str(item[0]))
    if not isinstance(params, Iterable) or isinstance(params, (str, bytes, torch.Tensor)):
        raise ParametersTypeError(f"gradsync.broadcast_parameters: expected model.state_dict(), "
                                  f"model.named_parameters() or a list of tensors, got a "
                                  f"{type(params).__module__}.{type(params).__qualname__}")
    items = []
    for item in params:
        if isinstance(item, tuple) and len(item) == 2:
            items.append(item)
        elif isinstance(item, torch.Tensor):
            items.append((None, item))
        else:
            raise ParametersTypeError("gradsync.broadcast_parameters: expected (name, tensor) pairs "
                                      f"or tensors, got a {type(item).__qualname__}")
    return items


def broadcast_parameters(params: Mapping[str, torch.Tensor] | Iterable[Any], root_rank: int = 0,
                         process_set: ProcessSet = global_process_set) -> None:
    """Overwrite every rank's tensors with ``root_rank``'s, in place (``horovod.torch.broadcast_parameters``).

    Call it after building the model (and after loading a checkpoint on the root) so that every rank
    starts from the same weights, as DDP does at construction.

    Args:
        params: ``model.state_dict()`` (parameters and buffers), ``model.named_parameters()``, or a
            list of tensors (``list(model.parameters())``, named by position); the same names,
            shapes and dtypes on every rank. ``None`` values are skipped. A name that repeats
            among the pairs (two modules' ``named_parameters()`` chained) is told apart by its
            position.
        root_rank: the (world) rank whose values win.
        process_set: the ranks that take part (default: every rank); ``root_rank`` must be one.

    Raises:
        ParametersTypeError (a TypeError and a ValueError): ``params`` is none of those kinds.
        ValueError: ``root_rank`` out of range. CollectiveError: shapes or dtypes differ by rank.
    """
    named = [(name, tensor) for name, tensor in _named(params) if tensor is not None]
    # Pairs from several modules may repeat a name ("0.weight"): a repeat gets its position.
    names = iter(naming.deduplicated([f"broadcast.{name}" for name, _ in named if name is not None]))
    with ops.blocking(process_set):  # submitted together, negotiated in this thread's cycles
        handles = [ops.broadcast_async_(tensor.detach(), root_rank,
                                        name=None if name is None else next(names),
                                        process_set=process_set)
                   for name, tensor in named]
        for handle in handles:
            ops.synchronize(handle)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0,
                              model: torch.nn.Module | None = None,
                              process_set: ProcessSet = global_process_set) -> None:
    """Make every rank's optimizer state and hyper-parameters equal to ``root_rank``'s
    (``horovod.torch.broadcast_optimizer_state``).

    The root's whole ``optimizer.state_dict()`` (per-parameter state such as momentum buffers and
    Adam moments, and every param group's options such as lr, momentum and betas, with their Python
    types) is broadcast and loaded with ``load_state_dict``; an optimizer that has not stepped yet
    (Adam before its first step) simply receives the root's state, empty or not, and L-BFGS works
    too. On a rank whose state is still empty, every parameter with ``requires_grad`` and no
    gradient gets a zero one (sparse for ``torch.optim.SparseAdam``, and for ``SGD`` on the sparse
    embeddings of ``model``), as Horovod leaves them. Unlike Horovod, gradsync does not step the
    optimizer on those zero gradients to create its state: that step would make the first real
    one differ from a fresh optimizer's (momentum from weight decay, Adam's step count), and
    training from single-process training.

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
    if not optimizer.state:
        _zero_missing_gradients(optimizer, model)
    state: Any = _on_host(optimizer.state_dict()) if rt.rank == root_rank else None
    state = ops.broadcast_object(state, root_rank, name="broadcast_optimizer_state",
                                 process_set=process_set)
    if rt.rank != root_rank:
        optimizer.load_state_dict(state)


def _zero_missing_gradients(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None) -> None:
    """Horovod's zero gradients for the parameters that have none (see broadcast_optimizer_state)."""
    sparse = set()
    if model is not None:
        sparse = {id(p) for m in model.modules()
                  if isinstance(m, torch.nn.Embedding) and m.sparse for p in m.parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
                if isinstance(optimizer, torch.optim.SparseAdam) or (
                        isinstance(optimizer, torch.optim.SGD) and id(p) in sparse):
                    p.grad = p.grad.to_sparse()


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
