"""The optimizers of a Lightning run, made data-parallel by gradsync.torch (nothing decided here).

Each optimizer is wrapped in place by ``gradsync.DistributedOptimizer`` (or
``gradsync.ZeroRedundancyOptimizer``), named by the module's parameter names, with the arguments
the user gave the strategy. What is Lightning's own here: Lightning creates LR schedulers before a
strategy sees the optimizers, and torch's schedulers replace ``optimizer.step`` on the object;
:func:`wrap` moves that bookkeeping onto the wrapped step.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

import gradsync.torch as gs_torch


def named_parameters(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list:
    """(name, parameter) for the parameters of ``module`` that ``optimizer`` updates."""
    owned = {p for group in optimizer.param_groups for p in group["params"]}
    return [(name, p) for name, p in module.named_parameters() if p in owned]


def wrap(optimizer: torch.optim.Optimizer, module: torch.nn.Module, zero: bool,
         options: dict[str, Any]) -> torch.optim.Optimizer:
    """``optimizer`` wrapped in place by gradsync.torch's ``DistributedOptimizer`` (or
    ``ZeroRedundancyOptimizer`` with ``zero``), with ``options`` (that class's keyword arguments)
    and the parameter names of ``module``. An LR scheduler's step counter on the object (torch's
    ``_opt_called`` bookkeeping) is kept, on the wrapped step.

    Raises:
        ValueError, TypeError: as gradsync.torch.DistributedOptimizer / ZeroRedundancyOptimizer.
    """
    replaced = vars(optimizer).pop("step", None)  # an LR scheduler's wrapper of the plain step
    wrapper = gs_torch.ZeroRedundancyOptimizer if zero else gs_torch.DistributedOptimizer
    try:
        wrapped = wrapper(optimizer, named_parameters=named_parameters(module, optimizer), **options)
    except BaseException:
        if replaced is not None:
            optimizer.step = replaced
        raise
    if getattr(replaced, "_wrapped_by_lr_sched", False):
        wrapped.step = _counted_step(wrapped)
    return wrapped


def _counted_step(optimizer: torch.optim.Optimizer) -> Callable:
    """The wrapped class's step, marking ``_opt_called`` as torch's LR schedulers expect (they warn
    when ``scheduler.step()`` comes before any ``optimizer.step()``)."""
    step = type(optimizer).step

    @functools.wraps(step)
    def counted(*args, **kwargs):
        optimizer._opt_called = True
        return step(optimizer, *args, **kwargs)

    counted._wrapped_by_lr_sched = True
    return counted


@contextlib.contextmanager
def synchronized(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Average this step's gradients now (free when backward already did), and let ``step()``
    inside the block run without a second round or Horovod's warning about one."""
    optimizer.synchronize()
    with optimizer.skip_synchronize():
        yield


def zero_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` (or the one a Lightning/Fabric wrapper holds) shards its state."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return hasattr(inner, "consolidate_state_dict") and hasattr(inner, "shard_plan")
