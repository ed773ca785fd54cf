"""Lightning's collectives (``reduce``, ``all_gather``, ``broadcast``, ``barrier``) on gradsync's.

Both strategies (Trainer and Fabric) call these, so ``self.log(..., sync_dist=True)``,
``all_gather``, ``trainer.validate/test/predict`` and torchmetrics sync through gradsync's
coordinator, never through ``torch.distributed`` (which a gradsync job does not initialise).
"""

from __future__ import annotations

from typing import Any

import torch

import gradsync
import gradsync.torch as gs_torch

# Lightning's reduce_op names (strings or torch.distributed.ReduceOp members) -> gradsync's ops.
_OPS = {"sum": gradsync.Sum, "mean": gradsync.Average, "avg": gradsync.Average,
        "max": gradsync.Max, "min": gradsync.Min, "product": gradsync.Product,
        "prod": gradsync.Product}


def _op_name(reduce_op: Any) -> str:
    if reduce_op is None:
        return "mean"
    name = getattr(reduce_op, "name", None) or str(reduce_op)  # torch's ReduceOp.SUM -> "SUM"
    return name.rsplit(".", 1)[-1].lower()


def reduce(tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
    """Reduce ``tensor`` over every rank (Lightning's ``Strategy.reduce``); anything that is not a
    tensor comes back unchanged, as in Lightning's DDP strategy.

    ``reduce_op``: ``"mean"``/``"avg"``/None (the default), ``"sum"``, ``"max"``, ``"min"``,
    ``"product"``, or a ``torch.distributed.ReduceOp`` of these. A mean of an integer or bool tensor
    is the float sum divided by the number of ranks (the core's Average divisor), as DDP's. The
    result has the input's shape and device; it is a new tensor.

    Raises:
        ValueError: a ``group`` (gradsync reduces over every rank here: use gradsync's process sets
            directly), or an unknown ``reduce_op`` (named).
    """
    if not isinstance(tensor, torch.Tensor):
        return tensor
    if group is not None:
        raise ValueError(f"gradsync: rank {gradsync.rank()}: reduce(group={group!r}): the gradsync "
                         "strategy reduces over every rank; leave group unset")
    name = _op_name(reduce_op)
    if name not in _OPS:
        raise ValueError(f"gradsync: rank {gradsync.rank()}: unknown reduce_op {reduce_op!r}; use one "
                         f"of {sorted(_OPS)}")
    if _OPS[name] is gradsync.Average and not tensor.is_floating_point():
        # summed exactly in float64, divided by the core's Average divisor, then torch's float dtype
        return gs_torch.allreduce(tensor.double(), op=gradsync.Average).to(torch.get_default_dtype())
    if tensor.dtype == torch.bool:
        tensor = tensor.long()
    return gs_torch.allreduce(tensor, op=_OPS[name])


def all_gather(tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
    """Every rank's ``tensor`` stacked along a new first dimension, in rank order (Lightning's
    ``Strategy.all_gather``): shape ``(size, *tensor.shape)``. The shapes must agree across ranks.
    With ``sync_grads`` the result is differentiable (the gradient of this rank's slice flows back,
    averaged, as gradsync.torch.allgather's); otherwise it is detached.

    Raises:
        ValueError: a ``group`` (see :func:`reduce`).
    """
    if group is not None and group is not torch.distributed.group.WORLD:
        raise ValueError(f"gradsync: rank {gradsync.rank()}: all_gather(group={group!r}): the gradsync "
                         "strategy gathers from every rank; leave group unset")
    source = tensor if sync_grads else tensor.detach()
    return gs_torch.allgather(source.unsqueeze(0))


def gather_all_tensors(tensor: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
    """torchmetrics' ``dist_sync_fn`` on gradsync: the list of every rank's ``tensor``, in rank
    order; their shapes may differ (each rank's shape is gathered first)."""
    shapes = gradsync.allgather_object(tuple(tensor.shape))
    flat = gs_torch.allgather(tensor.detach().reshape(-1))
    sizes = [int(torch.Size(shape).numel()) for shape in shapes]
    return [part.reshape(shape) for part, shape in zip(torch.split(flat, sizes), shapes)]


def connect_metrics(module: torch.nn.Module) -> None:
    """Make every torchmetrics ``Metric`` inside ``module`` sync its state through gradsync (its
    ``dist_sync_fn``), when the job has more than one rank; a metric with a ``dist_sync_fn`` of
    its own keeps it."""
    try:
        from torchmetrics import Metric
    except ImportError:
        return
    for metric in module.modules():
        if isinstance(metric, Metric) and metric.dist_sync_fn is None:
            metric.dist_sync_fn = gather_all_tensors
            metric.distributed_available_fn = _more_than_one_rank


def _more_than_one_rank() -> bool:
    return gradsync.size() > 1


def broadcast(obj: Any, src: int = 0) -> Any:
    """``src``'s ``obj`` (any picklable object) on every rank (Lightning's ``Strategy.broadcast``)."""
    return gradsync.broadcast_object(obj, root_rank=src)


def barrier(name: str | None = None) -> None:
    """Wait until every rank has called it (Lightning's ``Strategy.barrier``); ``name`` is
    Lightning's label and not used as the collective's name (ranks may label it differently)."""
    gradsync.barrier()


class CollectivesMixin:
    """Lightning's collective hooks on gradsync's, for both strategies (Trainer and Fabric: the
    Trainer calls ``reduce``, Fabric ``all_reduce``), and their registration under the names
    ``"gradsync"`` and ``"gradsync_zero"``. Mixed in before Lightning's ParallelStrategy."""

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """See :func:`gradsync.lightning.collectives.reduce`."""
        return reduce(tensor, group, reduce_op)

    def all_reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """See :func:`gradsync.lightning.collectives.reduce`."""
        return reduce(tensor, group, reduce_op)

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        """See :func:`gradsync.lightning.collectives.all_gather`."""
        return all_gather(tensor, group, sync_grads)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """See :func:`gradsync.lightning.collectives.broadcast`."""
        return broadcast(obj, src)

    def barrier(self, name: str | None = None) -> None:
        """See :func:`gradsync.lightning.collectives.barrier`."""
        barrier(name)

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        """``strategy="gradsync"`` and ``strategy="gradsync_zero"`` (sharded optimizer state)."""
        for name, zero in (("gradsync", False), ("gradsync_zero", True)):
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=f"gradsync data parallel (zero={zero})",
                                           zero=zero)
