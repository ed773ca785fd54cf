"""The PyTorch backend of gradsync.keras: gradients are torch tensors, the train step runs eagerly.

:func:`gradsync.torch.grouped_allreduce` reduces them as one unit (one negotiation, one fused
buffer per dtype), as gradsync.torch's own DistributedOptimizer does.
"""

from __future__ import annotations

from typing import Any

from ..engine.protocol import ReduceOp
from ..process_sets import ProcessSet
from ..torch import grouped_allreduce as _grouped_allreduce


def grouped_allreduce(grads: list[Any], name: str, op: ReduceOp, process_set: ProcessSet,
                      prescale: float = 1.0, postscale: float = 1.0) -> list[Any]:
    """Reduce ``grads`` (torch tensors) as one unit; returns new tensors in order."""
    return _grouped_allreduce(list(grads), name=name, op=op, process_set=process_set,
                              prescale_factor=prescale, postscale_factor=postscale)


def densify(grads: list[Any]) -> list[Any]:
    """``grads`` as they are: this backend's gradients are always dense."""
    return list(grads)
