"""The PyTorch backend of gradsync.keras: gradients are torch tensors, the train step runs eagerly.

Each gradient is its own in-place allreduce (gradient i named ``<name>[i]``), all submitted before
any is waited for, as gradsync.torch's own DistributedOptimizer reduces ``.grad``: the core fuses
the small ones and reduces a large one alone in the tensor's own memory. A grouped allreduce would
pack every gradient into one fusion buffer and unpack the results into new tensors: two copies of
the model's gradients per step (1.2 ms of a 20 ms step of a 7.4 MB MLP on 2 cores,
docs/benchmarks.md). The tensors are Keras's own ``.grad`` (or compression's new ones), which
nothing reads until the optimizer applies them.
"""

from __future__ import annotations

from typing import Any

from .. import ops
from ..engine.protocol import ReduceOp
from ..process_sets import ProcessSet
from ..torch.mpi_ops import allreduce_async_, synchronize


def grouped_allreduce(grads: list[Any], name: str, op: ReduceOp, process_set: ProcessSet,
                      prescale: float = 1.0, postscale: float = 1.0) -> list[Any]:
    """Reduce ``grads`` (torch tensors, any shapes and dtypes gradsync supports) in place, each its
    own collective ``<name>[i]``; returns them, in order. Every rank must pass the same count,
    shapes and dtypes; errors as :func:`gradsync.torch.allreduce_async_`."""
    with ops.blocking(process_set):  # the cycles run in this thread when the coordinator is idle
        handles = [allreduce_async_(g, name=f"{name}[{i}]", op=op, prescale_factor=prescale,
                                    postscale_factor=postscale, process_set=process_set)
                   for i, g in enumerate(grads)]
        return [synchronize(h) for h in handles]


def densify(grads: list[Any]) -> list[Any]:
    """``grads`` as they are: this backend's gradients are always dense."""
    return list(grads)
