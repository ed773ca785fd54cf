"""ZeroRedundancyOptimizer: optimizer state sharded over the ranks (ZeRO stage 1).

Each rank owns a balanced shard of the parameters (:func:`gradsync.torch.buckets.shard_plan`) and
keeps optimizer state only for it. The periods, hooks and end-of-backward wait are
DistributedOptimizer's (:mod:`gradsync.torch.periods`); the reduction is a strategy of its own,
:class:`ShardReducer`:

* during backward, each *bucket* of parameters is reduce-scattered as soon as its last gradient is
  ready: a persistent buffer of shape ``(ranks, width)`` whose row r holds the gradients of the
  bucket's parameters that rank r owns (zero padding to the longest row), so that each rank
  receives the average of its own parameters' gradients;
* ``step()`` runs the wrapped optimizer on this rank's shard only, then every parameter is
  broadcast in place from its owner, so every rank holds the same parameters when step() returns.

docs/sharding.md explains the choices and their costs.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable

import numpy as np
import torch

from .. import ops, runtime
from ..compression import Compression
from ..process_sets import ProcessSet, global_process_set
from ..protocol import ReduceOp
from .buckets import DEFAULT_SHARD_BUCKET_BYTES, ShardBucket, ShardPlan, shard_plan
from .factory import wrap_in_place
from .functions import _on_host
from .gradients import GradientReducer, Reduction, call_all
from .periods import _DistributedOptimizer

DEFAULT_BUCKET_BYTES = DEFAULT_SHARD_BUCKET_BYTES
BROADCAST_BYTES = 64 << 10  # parameters this large are broadcast alone, in place; smaller ones packed


class ShardReducer(GradientReducer):
    """The ZeRO strategy: a reduction whose buckets are the shard plan's, each reduce-scattered to
    the owners of its parameters (Average over the process set); after the round, this rank's
    other parameters have no gradient (None). Its :meth:`step` runs the wrapped optimizer's step
    (on this rank's shard), then broadcasts every parameter from its owner. Registers one
    post-accumulate-grad hook per parameter; parameters cannot be added after :meth:`plan`.

    Every round also carries one small allreduce (Max) of whether this rank is still training:
    :meth:`ZeroOptimizer.join` keeps a rank that ran out of data stepping with the others.

    Args:
        reduction: Average, no scaling or compression, sparse gradients densified.
        rank: this process's world rank, for messages.
        bucket_bytes: the plan's bucket size (:func:`gradsync.torch.buckets.shard_plan`).
    """

    def __init__(self, reduction: Reduction, rank: int, bucket_bytes: int) -> None:
        super().__init__(reduction, rank)
        self.bucket_bytes = bucket_bytes
        self.size = reduction.process_set.size()
        self.shards = ShardPlan((), {}, self.size)
        self.me = reduction.process_set.rank()
        self.active = 1  # 0 while this rank stands in from join()
        self.groups: dict[torch.Tensor, tuple[int, tuple[torch.Tensor, ...]]] = {}
        self._buffers: list[torch.Tensor] = []
        self._flagged = False  # this round's "still training" allreduce was submitted

    def plan(self) -> None:
        """Plan the shards of every attached parameter; the buffers and the broadcasts' layout."""
        plan = self.shards = shard_plan(list(self.names), self.size, self.bucket_bytes)
        self.groups = {slot.param: (b.index, b.members) for b in plan.buckets for slot in b.slots}
        self._buffers = [b.slots[0].param.new_zeros((plan.size, b.width)) for b in plan.buckets]
        self._roots = {p: self.reduction.process_set.ranks[r] for p, r in plan.owner.items()}
        self._large = [p for p in self.names if p.numel() * p.element_size() >= BROADCAST_BYTES]
        small: dict[tuple, list[list[torch.Tensor]]] = {}  # (device, dtype) -> each rank's params
        for param in self.names:
            if param.numel() * param.element_size() < BROADCAST_BYTES:
                ranks = small.setdefault((param.device, param.dtype), [[] for _ in range(self.size)])
                ranks[plan.owner[param]].append(param)
        self._small = list(small.values())

    def owned(self, param: torch.Tensor) -> bool:
        return self.shards.owner.get(param) == self.me

    def active_flag_name(self) -> str:
        return f"gradsync.zero.active.{self.first_name()}"

    def hand_over(self, param: torch.Tensor) -> None:
        self._flag_round()
        super().hand_over(param)

    def finish_round(self) -> None:
        """As GradientReducer's; then this rank's gradients of parameters it does not own are
        dropped (set to None): only the owner holds the average."""
        if not self.names:
            return
        self._flag_round()
        try:
            super().finish_round()
        finally:
            self._flagged = False
        for param in self.names:
            if not self.owned(param):
                param.grad = None

    def averaged_by_last_round(self, param: torch.Tensor) -> bool:
        """A dropped gradient counts as averaged while this rank's own averages are still there."""
        if self.owned(param):
            return super().averaged_by_last_round(param)
        return any(super(ShardReducer, self).averaged_by_last_round(p)
                   for p in self.names if self.owned(p))

    def _flag_round(self) -> None:
        if self._flagged:
            return
        self._flagged = True
        handle = ops.allreduce_async(np.array([self.active], np.int8), name=self.active_flag_name(),
                                     op=ReduceOp.Max, process_set=self.reduction.process_set)
        self._round.waits.append(functools.partial(ops.synchronize, handle))

    def skip_flag(self) -> None:
        """This round's flag was exchanged by join() already."""
        self._flagged = True

    def _ready(self, param: torch.Tensor, grad: torch.Tensor | None) -> None:
        """Count ``param`` ready in its bucket; the bucket's last one starts the bucket."""
        index, members = self.groups[param]
        if self._count_ready(index, len(members)):
            self._start_bucket(self.shards.buckets[index], self._buffers[index])

    def _start_bucket(self, bucket: ShardBucket, buffer: torch.Tensor) -> None:
        """Pack the bucket's gradients into its buffer (zeros where no rank has one) and start its
        reducescatter."""
        with torch.no_grad():
            for slot in bucket.slots:
                row = buffer[slot.owner, slot.start:slot.start + slot.numel]
                grad = slot.param.grad
                if grad is None:
                    row.zero_()
                else:
                    row.copy_(grad.reshape(-1))
        handle = ops.reducescatter_async(buffer, name=f"gradsync.zero.bucket.{bucket.index}."
                                         f"{self.first_name()}", op=self.reduction.op,
                                         process_set=self.reduction.process_set)
        finishes = self._round.finishes

        def wait() -> None:
            row = ops.synchronize(handle)[0]
            finishes.append(functools.partial(self._unpack, bucket, row))

        self._round.waits.append(wait)

    def _unpack(self, bucket: ShardBucket, row: torch.Tensor) -> None:
        with torch.no_grad():
            for slot in bucket.slots:
                grad = slot.param.grad
                if slot.owner == self.me and grad is not None:
                    grad.copy_(row[slot.start:slot.start + slot.numel].view_as(grad))

    def step(self, run_step: Callable, closure: Callable | None):
        """The wrapped optimizer's step on this rank's shard, then every parameter from its owner."""
        result = run_step(closure)
        self._broadcast_parameters()
        return result

    def _broadcast_parameters(self) -> None:
        """Every parameter from its owner: large ones broadcast in place (no copy), the small ones
        of each (device, dtype) packed and allgathered together (one collective, not one each)."""
        if self.size == 1:
            return
        process_set = self.reduction.process_set
        waits = [functools.partial(ops.synchronize, ops.broadcast_async_(
                     param.detach(), self._roots[param], name=f"gradsync.zero.param.{self.names[param]}",
                     process_set=process_set)) for param in self._large]
        for index, ranks in enumerate(self._small):
            with torch.no_grad():
                mine = [p.detach().reshape(-1) for p in ranks[self.me]]
                any_param = next(p for params in ranks for p in params)
                flat = torch.cat(mine) if mine else any_param.new_empty(0)
            handle = ops.allgather_async(flat, name=f"gradsync.zero.small.{index}.{self.first_name()}",
                                         process_set=process_set)
            waits.append(functools.partial(self._unpack_small, handle, ranks))
        call_all(waits)

    def _unpack_small(self, handle, ranks: list[list[torch.Tensor]]) -> None:
        gathered, start = ops.synchronize(handle), 0
        with torch.no_grad():
            for r, params in enumerate(ranks):
                for param in params:
                    if r != self.me:
                        param.copy_(gathered[start:start + param.numel()].view_as(param))
                    start += param.numel()

    def after_zero_grad(self, set_to_none: bool) -> None:
        """Zero the gradients of the parameters this rank does not own too."""
        for param in self.names:
            if not self.owned(param) and param.grad is not None:
                if set_to_none:
                    param.grad = None
                else:
                    param.grad.detach_().zero_()

    def clip_grad_norm(self, max_norm: float, norm_type: float) -> torch.Tensor:
        """See :meth:`ZeroOptimizer.clip_grad_norm_` (the round has finished)."""
        grads = [p.grad for p in self.names if self.owned(p) and p.grad is not None]
        infinite = math.isinf(norm_type)
        local = [g.detach().abs().max().double() if infinite else
                 g.detach().double().abs().pow(norm_type).sum() for g in grads]
        value = torch.stack(local).max() if infinite and local else sum(local, torch.zeros((),
                                                                                 dtype=torch.float64))
        total = ops.allreduce(value.cpu().reshape(1), name=f"gradsync.zero.grad_norm.{self.first_name()}",
                              op=ReduceOp.Max if infinite else ReduceOp.Sum,
                              process_set=self.reduction.process_set)[0]
        norm = total if infinite else total.pow(1.0 / norm_type)
        coefficient = float(max_norm) / (norm.item() + 1e-6)
        if coefficient < 1.0:
            with torch.no_grad():
                for grad in grads:
                    grad.mul_(coefficient)
        return norm

    def others_train(self) -> bool:
        """While this rank stands in (join): one allreduce (Max) of the ranks' "still training"
        flags, this rank's 0; True if some rank still trains (this round's flag is then spent)."""
        flag = ops.allreduce(np.zeros(1, np.int8), name=self.active_flag_name(), op=ReduceOp.Max,
                             process_set=self.reduction.process_set)
        return bool(flag[0])


class ZeroOptimizer(_DistributedOptimizer):
    """Mixed in before the wrapped optimizer's class; see :func:`ZeroRedundancyOptimizer`."""

    def _gradsync_setup(self, named_parameters: dict, backward_passes_per_step: int,
                        strategy: GradientReducer, synchronize_in_backward: bool) -> None:
        """DistributedOptimizer's setup with ``strategy`` (a :class:`ShardReducer`); then keep only
        this rank's shard in the wrapped optimizer's param groups and state."""
        super()._gradsync_setup(named_parameters, backward_passes_per_step, strategy,
                                synchronize_in_backward)
        self._zero = shards = strategy
        self._zero_groups = [list(group["params"]) for group in self.param_groups]
        self._zero_index = {p: i for i, p in enumerate(p for g in self._zero_groups for p in g)}
        for group in self.param_groups:
            group["params"] = [p for p in group["params"] if shards.owned(p)]
        for param in [p for p in self.state if not shards.owned(p)]:
            del self.state[param]
        self._zero_consolidated: dict | None = None

    @property
    def shard_plan(self) -> ShardPlan:
        """Which rank owns which parameter (indices in the process set), and the buckets."""
        return self._zero.shards

    def step(self, closure: Callable[[], torch.Tensor] | None = None):
        """Average this period's gradients as DistributedOptimizer's step() does, step this rank's
        shard, then broadcast every parameter from its owner (in place), so that every rank holds
        the same parameters when step() returns.

        Raises:
            As DistributedOptimizer's ``step()``.
        """
        self._zero_consolidated = None  # a consolidated state is the state before this step
        return super().step(closure)

    def add_param_group(self, param_group: dict) -> None:
        """Refused: the shards are planned once, when the optimizer is wrapped.

        Raises:
            ValueError: always, after wrapping (add every group before wrapping).
        """
        if not hasattr(self, "_zero_groups"):
            super().add_param_group(param_group)
            return
        raise ValueError(f"gradsync: rank {self._zero.rank}: ZeroRedundancyOptimizer plans its shards "
                         "once: add every param group before wrapping the optimizer")

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the averaged gradients by their global norm, as ``torch.nn.utils.clip_grad_norm_``
        over every parameter of the model in one process would.

        Synchronizes first (if the period's gradients are not averaged yet); then each rank sums
        its own shard's ``|g|^p`` (float64), one allreduce (Sum; Max for ``inf``) gives the
        total, and each rank scales its shard by ``max_norm / (norm + 1e-6)`` when that is below 1.
        Call it between ``backward()`` and ``step()`` on every rank.

        Returns:
            The total norm before clipping (float64 tensor, on the host), the same on every rank.

        Raises:
            RuntimeError: as :meth:`synchronize` (a gradient changed in place or replaced while
                its reducescatter was in flight).
        """
        self.synchronize()
        return self._zero.clip_grad_norm(max_norm, norm_type)

    def join(self) -> None:
        """Keep taking part in the other ranks' steps until every rank has called join().

        For uneven data: a rank that runs out of batches calls ``optimizer.join()`` instead of
        its training loop. While other ranks still train, it steps with them, contributing zeros
        to the average (Average divides by the number of ranks, as ``gradsync.join()``), updating
        its own shard with their gradients and broadcasting it. Every rank must call it once it
        has no more data, between steps. The ranks that still train must submit no collectives
        other than this optimizer's while some rank stands in here.

        Raises:
            RuntimeError: gradients are still being reduced (call step() or zero_grad() first).
        """
        shards = self._zero
        shards.refuse_in_flight("optimizer.join() was called")
        shards.active = 0
        try:
            while shards.others_train():
                self.zero_grad(set_to_none=True)
                shards.skip_flag()
                shards.finish_round()  # zeros for every gradient, as the others' step
                with self.skip_synchronize():
                    self.step()
        finally:
            shards.active = 1
        self.zero_grad(set_to_none=True)

    # --- checkpoints -------------------------------------------------------------------------

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the whole optimizer state on world rank ``to`` (same semantics as torch's
        ``ZeroRedundancyOptimizer.consolidate_state_dict``); every rank of the process set must
        call it. Each rank's shard travels by :func:`gradsync.broadcast_object` from that rank in
        turn (host copies), so a rank holds at most one other shard at a time.

        Raises:
            ValueError: ``to`` is not a rank of the optimizer's process set.
        """
        if to not in self._zero.reduction.process_set.ranks:
            raise ValueError(f"gradsync: rank {self._zero.rank}: consolidate_state_dict(to={to!r}): "
                             f"not a rank of {self._zero.reduction.process_set}")
        mine = _on_host(self._zero_shard_state())
        state: dict = {}
        for root in self._zero.reduction.process_set.ranks:
            shard = ops.broadcast_object(mine if root == self._zero.rank else None, root,
                                         name=f"gradsync.zero.consolidate.{root}",
                                         process_set=self._zero.reduction.process_set)
            if self._zero.rank == to:
                state.update(shard)
        self._zero_consolidated = None
        if self._zero.rank == to:
            groups = torch.optim.Optimizer.state_dict(self)["param_groups"]
            self._zero_consolidated = {"state": dict(sorted(state.items())), "param_groups": [
                dict(group, params=[self._zero_index[p] for p in full])
                for group, full in zip(groups, self._zero_groups)]}

    def _zero_shard_state(self) -> dict:
        """This rank's state, keyed by the parameter's index in the whole optimizer."""
        local = torch.optim.Optimizer.state_dict(self)
        owned = [p for group in self.param_groups for p in group["params"]]
        return {self._zero_index[owned[i]]: value for i, value in local["state"].items()}

    def state_dict(self) -> dict:
        """The consolidated state (in the wrapped optimizer's own format, with the indices of the
        whole optimizer: loadable into a ZeroRedundancyOptimizer at any number of ranks, or into
        the plain optimizer), on the rank that :meth:`consolidate_state_dict` gathered it to.

        Raises:
            RuntimeError: no consolidate_state_dict() to this rank since the last step().
        """
        if self._zero_consolidated is None:
            raise RuntimeError(
                f"gradsync: rank {self._zero.rank}: ZeroRedundancyOptimizer.state_dict(): the state "
                "is sharded; call optimizer.consolidate_state_dict(to=R) on every rank first, then "
                "state_dict() on rank R")
        return self._zero_consolidated

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a whole (consolidated) state: this rank keeps the state of its own parameters and
        every group's hyper-parameters. Call it on every rank with the same state; a state saved
        at another number of ranks, or by the plain optimizer, loads alike.

        Raises:
            ValueError: the state's groups differ in number or length from the optimizer's.
        """
        groups = state_dict["param_groups"]
        lengths = [len(g["params"]) for g in groups]
        if lengths != [len(g) for g in self._zero_groups]:
            raise ValueError(f"gradsync: rank {self._zero.rank}: the loaded state has param groups "
                             f"of {lengths} parameters, this optimizer {[len(g) for g in self._zero_groups]}")
        owned = [p for group in self.param_groups for p in group["params"]]
        by_position = {self._zero_index[p]: i for i, p in enumerate(owned)}
        saved = [i for group in groups for i in group["params"]]  # by position in the optimizer
        local_state = {by_position[n]: state_dict["state"][key] for n, key in enumerate(saved)
                       if n in by_position and key in state_dict["state"]}
        local_groups, start = [], 0
        for group in groups:
            mine = [by_position[n] for n in range(start, start + len(group["params"]))
                    if n in by_position]
            local_groups.append(dict(group, params=mine))
            start += len(group["params"])
        super().load_state_dict({"state": local_state, "param_groups": local_groups})



def ZeroRedundancyOptimizer(optimizer: torch.optim.Optimizer,
                            named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                            process_set: ProcessSet = global_process_set,
                            backward_passes_per_step: int = 1,
                            bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                            synchronize_in_backward: bool = True) -> torch.optim.Optimizer:
    """Make ``optimizer`` data-parallel with its state sharded over the ranks (ZeRO stage 1).

    Each rank of ``process_set`` owns a balanced shard of the parameters (by element count,
    planned from shapes and order alone, so the same on every rank) and keeps optimizer state only
    for it: the wrapped optimizer's ``param_groups`` on this rank list only its own parameters, with
    every group's hyper-parameters (LR schedulers created after wrapping work as usual). During
    backward the gradients are reduce-scattered bucket by bucket, so that when backward returns
    each rank holds the average of its own parameters' gradients (the others' ``p.grad`` are
    None); ``step()`` updates the shard and broadcasts each parameter from its owner before it
    returns. With equal per-rank batches, N ranks compute the same update as one process on the
    N-times larger batch, as DistributedOptimizer does, for any optimizer whose update of a
    parameter reads only that parameter's gradient and state (SGD, Adam, AdamW, RMSprop, ...; not
    LBFGS). Same role as ``torch.distributed.optim.ZeroRedundancyOptimizer``; docs/sharding.md
    lists the differences.

    DistributedOptimizer's contract holds (docs/getting-started.md): averaged when backward
    returns, zeros from a rank without a gradient, ``synchronize()``, ``skip_synchronize()``,
    ``step(closure)`` for optimizers that evaluate it once. Added: :meth:`ZeroOptimizer.clip_grad_norm_`
    (global norm over the shards), :meth:`ZeroOptimizer.join` (uneven data),
    :meth:`ZeroOptimizer.consolidate_state_dict` and a ``state_dict()``/``load_state_dict()`` in the
    plain optimizer's format. The optimizer is wrapped in place and returned.

    Args:
        optimizer: a ``torch.optim.Optimizer`` over host or CUDA parameters, with every param group
            it will have (``add_param_group`` is refused afterwards).
        named_parameters: ``model.named_parameters()``, as for DistributedOptimizer.
        process_set: the ranks that share the state (default: every rank).
        backward_passes_per_step: backward passes accumulated locally per step.
        bucket_bytes: gradient bytes per reduce-scattered bucket, at least (8 MiB by default); a
            bucket closes once its ranks' rows differ by at most 5 %, or at twice this size.
        synchronize_in_backward: as for DistributedOptimizer.

    Raises:
        ValueError: as DistributedOptimizer, and ``bucket_bytes < 1``.
        NotInitializedError: before ``gradsync.init()``.
    """
    rank = runtime.get().rank
    if int(bucket_bytes) < 1:
        raise ValueError(f"gradsync: rank {rank}: bucket_bytes must be >= 1, got {bucket_bytes!r}")
    named = None if named_parameters is None else list(named_parameters)
    reduction = Reduction(ReduceOp.Average, 1.0, 1.0, Compression.none, True, process_set)
    return wrap_in_place(optimizer, ZeroOptimizer, "ZeroRedundancy",
                         lambda: ShardReducer(reduction, rank, int(bucket_bytes)), named,
                         backward_passes_per_step, synchronize_in_backward)


__all__ = ["ZeroRedundancyOptimizer", "ZeroOptimizer", "ShardPlan", "shard_plan"]
