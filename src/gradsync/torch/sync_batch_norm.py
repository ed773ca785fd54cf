"""SyncBatchNorm: batch normalisation whose statistics cover every rank's batch.

Same semantics as ``horovod.torch.SyncBatchNorm`` and ``torch.nn.SyncBatchNorm``: in training, the
mean and variance normalising each channel are those of the concatenation of every rank's batch
(the ranks may hold different numbers of samples, even none), the running statistics are updated
with them (unbiased variance, as BatchNorm), and the input gradient is that of the sum of every
rank's loss, so it equals BatchNorm's on the concatenated batch. The weight and bias gradients
are this rank's own; DistributedOptimizer averages them as it does any other. Unlike Horovod's,
it runs on CPU tensors as well as CUDA ones.

Per call: forward allgathers each rank's sample count, per-channel mean and sum of squared
deviations (2C+1 float64 values per rank, combined exactly as in a parallel variance); backward
allreduces the two per-channel sums of the input gradient's formula (2C values). The collectives
are named by the number of channels C, so layers of one width reuse their negotiation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from .. import ops
from ..engine.protocol import Sum
from ..process_sets import ProcessSet, global_process_set

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(_BatchNorm):
    """Batch normalisation over the batches of every rank (of ``process_set``) together.

    Args:
        num_features: the number of channels C of inputs shaped (N, C, ...).
        eps: added to the variance for numerical stability.
        momentum: weight of the batch statistics in the running ones; None: cumulative average.
        affine: learnable per-channel weight and bias.
        track_running_stats: keep running mean and variance and use them in eval mode; False: use
            the (synchronised) batch statistics in eval mode too.
        process_set: the ranks whose batches are normalised together (default: every rank);
            gradsync's addition to Horovod's signature.

    Raises (from forward):
        ValueError: an input with fewer than 2 dimensions; in training, one sample per channel in
            all (over every rank), as BatchNorm.
        CollectiveError: the ranks disagree on the number of channels or the dtype.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_set: ProcessSet = global_process_set) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"gradsync: SyncBatchNorm expected at least 2D input (got {input.dim()}D "
                             "input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalise ``input`` (N, C, ...) per channel; returns a tensor of its shape and dtype."""
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
        batch_stats = self.training or not self.track_running_stats
        if not batch_stats or self.process_set.size() == 1:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias,
                                batch_stats, factor, self.eps)
        update = self.training and self.track_running_stats
        return _SyncBatchNorm.apply(input, self.weight, self.bias,
                                    self.running_mean if update else None,
                                    self.running_var if update else None,
                                    self.eps, factor, self.process_set)


def _stats_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class _SyncBatchNorm(torch.autograd.Function):
    """The synchronised normalisation and its gradient (module docstring)."""

    @staticmethod
    def forward(ctx, input, weight, bias, running_mean, running_var, eps, momentum, process_set):
        x = input.to(_stats_dtype(input.dtype))
        channels, dims = x.shape[1], [0, *range(2, x.dim())]
        count = x.numel() // channels if channels else 0
        local = torch.zeros(1, 2 * channels + 1, dtype=torch.float64, device=x.device)
        if count:
            mean = x.mean(dims)
            local[0, 0] = count
            local[0, 1:channels + 1] = mean.double()
            local[0, channels + 1:] = (x - _per_channel(mean, x)).square().sum(dims).double()
        every = ops.allgather(local, name=f"sync_batch_norm.{channels}.stats", process_set=process_set)
        counts, means, m2s = every[:, :1], every[:, 1:channels + 1], every[:, channels + 1:]
        total = float(counts.sum())
        if total <= 1:
            raise ValueError(f"gradsync: SyncBatchNorm: expected more than 1 value per channel when "
                             f"training, got {int(total)} over every rank")
        mean = (counts * means).sum(0) / total
        m2 = (m2s + counts * (means - mean).square()).sum(0)
        invstd = torch.rsqrt(m2 / total + eps)
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
            running_var.mul_(1 - momentum).add_((m2 / (total - 1)).to(running_var.dtype),
                                                alpha=momentum)
        mean, invstd = mean.to(x.dtype), invstd.to(x.dtype)
        ctx.save_for_backward(input, weight, mean, invstd)
        ctx.total, ctx.process_set = total, process_set
        out = (x - _per_channel(mean, x)) * _per_channel(invstd, x)
        if weight is not None:
            out = out * _per_channel(weight.to(x.dtype), x) + _per_channel(bias.to(x.dtype), x)
        return out.to(input.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        input, weight, mean, invstd = ctx.saved_tensors
        x = input.to(mean.dtype)
        grad = grad_output.to(mean.dtype)
        channels, dims = x.shape[1], [0, *range(2, x.dim())]
        xmu = x - _per_channel(mean, x)
        sums = torch.cat([grad.sum(dims), (grad * xmu).sum(dims)])  # sum(dy), sum(dy * (x - mean))
        grad_weight = grad_bias = None
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = (sums[channels:] * invstd).to(weight.dtype)
        if weight is not None and ctx.needs_input_grad[2]:
            grad_bias = sums[:channels].to(weight.dtype)
        # Every rank allreduces, whatever it needs: which collectives run must not depend on a rank.
        total = ops.allreduce(sums.contiguous(), name=f"sync_batch_norm.{channels}.grad", op=Sum,
                              process_set=ctx.process_set) / ctx.total
        scale = invstd if weight is None else invstd * weight.to(x.dtype)
        grad_input = (grad - _per_channel(total[:channels], x)
                      - xmu * _per_channel(invstd.square() * total[channels:], x)) * _per_channel(scale, x)
        return grad_input.to(input.dtype), grad_weight, grad_bias, None, None, None, None, None


def _per_channel(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``values`` (C,) shaped to broadcast over ``like`` (N, C, ...)."""
    return values.view(1, -1, *([1] * (like.dim() - 2)))
