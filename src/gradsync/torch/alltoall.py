"""Horovod's torch alltoall (``horovod.torch.alltoall``, ``alltoall_async``) on gradsync.

Part of Horovod's namespace (:mod:`gradsync.torch.mpi_ops` exports these as Horovod does); a
module of its own for the splits Horovod takes as a tensor of any device and returns in that
tensor's dtype and device, CUDA tensors staged through host memory (gradsync's alltoall is
host-only), and the autograd function whose gradient is the alltoall back along the received
splits. As Horovod's, it fails (CollectiveError, on every rank) while some rank has called join().
"""

from __future__ import annotations

from typing import Any

import torch

from .. import ops
from ..handles import Handle
from ..ops import synchronize
from ..process_sets import ProcessSet, global_process_set
from .basics import rank
from .collectives import Finishing, grad_name


def _split_values(splits: Any, where: str) -> Any:
    """``splits`` as gradsync takes them; Horovod's error for splits that are not integers."""
    if isinstance(splits, torch.Tensor) and (splits.dtype.is_floating_point or splits.is_complex()
                                             or splits.dtype == torch.bool):
        raise ValueError(f"{where}: splits must hold integers (Horovod: int32), got {splits.dtype}")
    return splits.cpu() if isinstance(splits, torch.Tensor) else splits


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> Handle:
    """Start an alltoall (``horovod.torch.alltoall_async``; MPI_Alltoallv along dimension 0).

    ``splits``: rows for each rank of the set (a sequence or an integer tensor, on any device);
    None splits evenly. :func:`synchronize` returns ``(output, received_splits)``, the received
    splits as a tensor of ``splits``'s dtype and device (int32 on the CPU when ``splits`` is not a
    tensor). CUDA tensors are staged through host memory.

    Raises:
        ValueError: floating-point splits; splits of the wrong length, negative, or not summing
            to ``shape[0]``; ``shape[0]`` not divisible by the set's size with splits=None.
            Others as :func:`gradsync.alltoall_async`.
    """
    values = _split_values(splits, f"gradsync: rank {rank()}: alltoall of tensor "
                                   f"{'(unnamed)' if name is None else repr(name)}")
    device = tensor.device if isinstance(tensor, torch.Tensor) else None
    host = tensor.cpu() if device is not None and device.type == "cuda" else tensor
    with ops.refusing_join():  # Horovod's alltoall fails beside a joined rank
        handle = ops.alltoall_async(host, values, name, process_set)
    like = splits if isinstance(splits, torch.Tensor) else torch.empty(0, dtype=torch.int32)

    def finish(result: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        output, received = result
        if device is not None and output.device != device:
            output = output.to(device)
        return output, received.to(dtype=like.dtype, device=like.device)

    return Finishing(handle, finish)


class HorovodAlltoall(torch.autograd.Function):
    """Alltoall as an autograd function: the gradient is the alltoall of the output's gradient back
    along the received splits (Horovod's). Returns the output alone when ``splits`` is None."""

    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        with ops.blocking(process_set):
            handle = alltoall_async(tensor, splits, name, process_set)
            output, received = synchronize(handle)
        ctx.name, ctx.process_set, ctx.recvsplits = handle.name, process_set, received
        if splits is None:
            return output
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad_output, *unused):
        grad, _ = alltoall(grad_output.contiguous(), ctx.recvsplits, grad_name(ctx.name),
                           ctx.process_set)
        return grad, None, None, None


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Alltoall ``tensor``, differentiably (``horovod.torch.alltoall``): as :func:`alltoall_async`.

    Returns:
        ``(output, received_splits)``, or ``output`` alone when ``splits`` is None (Horovod's).
    """
    return HorovodAlltoall.apply(tensor, splits, name, process_set)
