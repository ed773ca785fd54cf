"""ZeroRedundancyOptimizer: optimizer state sharded over the ranks (ZeRO stage 1).

The parameters are laid out flat in buckets and each bucket is split evenly by element over the
ranks (:func:`gradsync.torch.reducer.buckets.shard_plan`, DeepSpeed's ZeRO-1 partition): a parameter may
span owners, and each rank keeps optimizer state only for its elements. The periods, hooks and
end-of-backward wait are DistributedOptimizer's (:mod:`gradsync.torch.reducer.periods`); the reduction is
a strategy of its own, :class:`ShardReducer`:

* during backward, each bucket is reduce-scattered as soon as its last gradient is ready: a
  persistent ``(ranks, width)`` buffer holding the bucket's gradients flat, whose row r (the
  elements rank r owns) goes to rank r as the average over the ranks;
* ``step()`` runs the wrapped optimizer on this rank's shard tensors (the parameter where the rank
  owns all of it, else a flat view of its elements: :mod:`gradsync.torch.zero_state`), then one
  allgather per bucket brings every rank's updated elements to every rank.

docs/sharding.md explains the choices and their costs.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable

import numpy as np
import torch

from .. import ops
from ..compression import Compression
from ..engine.protocol import ReduceOp
from ..process import runtime
from ..process_sets import ProcessSet, global_process_set
from .functions import _on_host
from .reducer.buckets import DEFAULT_SHARD_BUCKET_BYTES, Piece, ShardBucket, ShardPlan, shard_plan
from .reducer.factory import wrap_in_place
from .reducer.gradients import GradientReducer, Reduction, call_all
from .reducer.periods import _DistributedOptimizer
from .zero_state import flat, merge_pieces, shard_tensor, slice_state

DEFAULT_BUCKET_BYTES = DEFAULT_SHARD_BUCKET_BYTES


class ShardReducer(GradientReducer):
    """The ZeRO strategy: a reduction whose buckets are the shard plan's, each reduce-scattered so
    that every rank receives the average (over the process set) of the elements it owns; after the
    round, this rank's gradients hold those averages and zeros elsewhere, and the gradients of
    parameters it owns nothing of are None. Its :meth:`step` runs the wrapped optimizer's step (on
    this rank's shard tensors, :func:`gradsync.torch.zero_state.shard_tensor`), then allgathers
    every bucket's updated elements from their owners. Registers one post-accumulate-grad hook per
    parameter; parameters cannot be added after :meth:`plan`.

    Every round also carries one small allreduce (Max) of whether this rank is still training:
    :meth:`ZeroOptimizer.join` keeps a rank that ran out of data stepping with the others.

    Args:
        reduction: Average, no scaling or compression, sparse gradients densified.
        rank: this process's world rank, for messages.
        bucket_bytes: the plan's bucket size (:func:`gradsync.torch.reducer.buckets.shard_plan`).
    """

    def __init__(self, reduction: Reduction, rank: int, bucket_bytes: int) -> None:
        super().__init__(reduction, rank)
        self.bucket_bytes = bucket_bytes
        self.size = reduction.process_set.size()
        self.shards = ShardPlan((), self.size)
        self.me = reduction.process_set.rank()
        self.active = 1  # 0 while this rank stands in from join()
        self.pieces: dict[torch.Tensor, Piece] = {}  # parameter -> this rank's piece of it
        self.shard_tensors: dict[torch.Tensor, torch.Tensor] = {}  # parameter -> what is stepped
        self._flagged = False  # this round's "still training" allreduce was submitted

    def plan(self) -> None:
        """Plan the shards of every attached parameter; the buckets' buffers and this rank's rows.

        Raises:
            ValueError: a parameter is not contiguous (its elements could not be split by views).
        """
        for param, name in self.names.items():
            if not param.is_contiguous():
                raise ValueError(f"gradsync: rank {self.rank}: ZeroRedundancyOptimizer shards "
                                 f"parameters by element: parameter {name!r} is not contiguous "
                                 f"(shape {tuple(param.shape)}, stride {param.stride()})")
        plan = self.shards = shard_plan(list(self.names), self.size, self.bucket_bytes)
        self.groups = {p: b.index for b in plan.buckets for p in b.members}
        self._buffers = [b.members[0].new_zeros((plan.size, b.width)) for b in plan.buckets]
        self._rows = [b.members[0].new_zeros(b.width) for b in plan.buckets]
        self._mine = [b.pieces(self.me) for b in plan.buckets]
        self.pieces = plan.pieces(self.me)
        self.shard_tensors = {p: shard_tensor(piece) for p, piece in self.pieces.items()}

    def owned(self, param: torch.Tensor) -> bool:
        """True if this rank owns some of ``param``'s elements."""
        return param in self.pieces

    def active_flag_name(self) -> str:
        return f"gradsync.zero.active.{self.first_name()}"

    def hand_over(self, param: torch.Tensor) -> None:
        self._flag_round()
        super().hand_over(param)

    def finish_round(self) -> None:
        """As GradientReducer's; then this rank keeps the averages of its own elements only: the
        gradients of parameters it owns nothing of are dropped (None), the others' elements of
        the parameters it shares are zeroed, and each shard tensor's ``grad`` is its elements."""
        if not self.names:
            return
        self._flag_round()
        try:
            super().finish_round()
        finally:
            self._flagged = False
        for param in self.names:
            piece = self.pieces.get(param)
            if piece is None:
                param.grad = None
            elif not piece.whole:
                self._point_shard_gradient(param, piece)

    def _point_shard_gradient(self, param: torch.Tensor, piece: Piece) -> None:
        """The shard tensor's gradient: a view of ``param.grad``'s own elements, the rest zeroed."""
        shard, grad = self.shard_tensors[param], param.grad
        if grad is None:
            shard.grad = None
            return
        if grad.layout != torch.strided or not grad.is_contiguous():
            param.grad = grad = grad.to_dense().contiguous()
        elements = flat(grad)
        with torch.no_grad():
            elements[:piece.start].zero_()
            elements[piece.start + piece.numel:].zero_()
        shard.grad = elements[piece.start:piece.start + piece.numel]

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
        index = self.groups[param]
        bucket = self.shards.buckets[index]
        if self._count_ready(index, len(bucket.members)):
            self._start_bucket(bucket, self._buffers[index])

    def _start_bucket(self, bucket: ShardBucket, buffer: torch.Tensor) -> None:
        """Pack the bucket's gradients flat into its ``(ranks, width)`` buffer (zeros where no
        rank has one) and start its reducescatter: row r goes to rank r."""
        elements = buffer.view(-1)
        with torch.no_grad():
            for param, offset in zip(bucket.members, bucket.offsets):
                row = elements[offset:offset + param.numel()]
                if param.grad is None:
                    row.zero_()
                else:
                    row.copy_(param.grad.reshape(-1))
        handle = ops.reducescatter_async(buffer, name=f"gradsync.zero.bucket.{bucket.index}."
                                         f"{self.first_name()}", op=self.reduction.op,
                                         process_set=self.reduction.process_set)
        finishes = self._round.finishes

        def wait() -> None:
            row = ops.synchronize(handle)[0]
            finishes.append(functools.partial(self._unpack, bucket, row))

        self._round.waits.append(wait)

    def _unpack(self, bucket: ShardBucket, row: torch.Tensor) -> None:
        """This rank's averaged elements of ``bucket`` (``row``) into its gradients."""
        with torch.no_grad():
            for piece in self._mine[bucket.index]:
                grad = piece.param.grad
                if grad is None:
                    continue
                if not grad.is_contiguous():
                    piece.param.grad = grad = grad.contiguous()
                flat(grad)[piece.start:piece.start + piece.numel].copy_(
                    row[piece.row_start:piece.row_start + piece.numel])

    def step(self, run_step: Callable, closure: Callable | None):
        """The wrapped optimizer's step on this rank's shard, then every bucket's elements from
        their owners."""
        result = run_step(closure)
        self._gather_parameters()
        return result

    def _gather_parameters(self) -> None:
        """One allgather per bucket of each rank's row of updated elements, unpacked into every
        parameter this rank does not own whole."""
        if self.size == 1:
            return
        waits = []
        for bucket, row in zip(self.shards.buckets, self._rows):
            with torch.no_grad():
                for piece in self._mine[bucket.index]:
                    row[piece.row_start:piece.row_start + piece.numel].copy_(
                        flat(piece.param)[piece.start:piece.start + piece.numel])
            handle = ops.allgather_async(row, name=f"gradsync.zero.params.{bucket.index}."
                                         f"{self.first_name()}", process_set=self.reduction.process_set)
            waits.append(functools.partial(self._unpack_parameters, bucket, handle))
        call_all(waits)

    def _unpack_parameters(self, bucket: ShardBucket, handle) -> None:
        gathered = ops.synchronize(handle)
        with torch.no_grad():
            for param, offset in zip(bucket.members, bucket.offsets):
                piece = self.pieces.get(param)
                if piece is None or not piece.whole:
                    flat(param).copy_(gathered[offset:offset + param.numel()])

    def after_zero_grad(self, set_to_none: bool) -> None:
        """Zero the gradients of the parameters this rank does not own whole too."""
        for param in self.names:
            piece = self.pieces.get(param)
            if (piece is None or not piece.whole) and param.grad is not None:
                if set_to_none:
                    param.grad = None
                else:
                    param.grad.detach_().zero_()

    def clip_grad_norm(self, max_norm: float, norm_type: float) -> torch.Tensor:
        """See :meth:`ZeroOptimizer.clip_grad_norm_` (the round has finished)."""
        grads = [t.grad for t in self.shard_tensors.values() if t.grad is not None]
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
        """DistributedOptimizer's setup with ``strategy`` (a :class:`ShardReducer`); then the
        wrapped optimizer's param groups and state hold this rank's shard tensors only."""
        super()._gradsync_setup(named_parameters, backward_passes_per_step, strategy,
                                synchronize_in_backward)
        self._zero = shards = strategy
        self._zero_groups = [list(group["params"]) for group in self.param_groups]
        self._zero_index = {p: i for i, p in enumerate(p for g in self._zero_groups for p in g)}
        # the parameters this rank steps some of, in the order of its shard tensors
        self._zero_owned = [p for g in self._zero_groups for p in g if shards.owned(p)]
        for group in self.param_groups:
            group["params"] = [shards.shard_tensors[p] for p in group["params"] if shards.owned(p)]
        state = {p: self.state.pop(p) for p in list(self.state)}
        for param, value in state.items():
            if shards.owned(param):
                self.state[shards.shard_tensors[param]] = slice_state(value, shards.pieces[param])
        self._zero_consolidated: dict | None = None

    @property
    def shard_plan(self) -> ShardPlan:
        """The buckets and which elements each rank (index in the process set) owns."""
        return self._zero.shards

    def step(self, closure: Callable[[], torch.Tensor] | None = None):
        """Average this period's gradients as DistributedOptimizer's step() does, step this rank's
        shard tensors, then allgather every bucket's elements from their owners, so that every
        rank holds the same parameters when step() returns.

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
        its own shard with their gradients and sending it. Every rank must call it once it
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
        call it. Each rank's pieces travel by :func:`gradsync.broadcast_object` from that rank in
        turn (host copies), so a rank holds at most one other shard at a time; the pieces of a
        parameter are put together by :func:`gradsync.torch.zero_state.merge_pieces`.

        Raises:
            ValueError: ``to`` is not a rank of the optimizer's process set.
        """
        process_set = self._zero.reduction.process_set
        if to not in process_set.ranks:
            raise ValueError(f"gradsync: rank {self._zero.rank}: consolidate_state_dict(to={to!r}): "
                             f"not a rank of {process_set}")
        mine = _on_host(self._zero_shard_state())
        pieces: dict[int, list] = {}
        for root in process_set.ranks:
            shard = ops.broadcast_object(mine if root == self._zero.rank else None, root,
                                         name=f"gradsync.zero.consolidate.{root}",
                                         process_set=process_set)
            if self._zero.rank == to:
                for index, piece in shard.items():
                    pieces.setdefault(index, []).append(piece)
        self._zero_consolidated = None
        if self._zero.rank == to:
            params = [p for g in self._zero_groups for p in g]
            groups = torch.optim.Optimizer.state_dict(self)["param_groups"]
            self._zero_consolidated = {
                "state": {i: merge_pieces(pieces[i], params[i], i) for i in sorted(pieces)},
                "param_groups": [dict(group, params=[self._zero_index[p] for p in full])
                                 for group, full in zip(groups, self._zero_groups)]}

    def _zero_shard_state(self) -> dict:
        """This rank's state: the parameter's index in the whole optimizer -> (the piece's first
        element, its element count, the shard tensor's state)."""
        local = torch.optim.Optimizer.state_dict(self)
        pieces = [self._zero.pieces[p] for p in self._zero_owned]
        return {self._zero_index[pieces[i].param]: (pieces[i].start, pieces[i].numel, value)
                for i, value in local["state"].items()}

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
        """Load a whole (consolidated) state: this rank keeps its pieces of every parameter's
        state (:func:`gradsync.torch.zero_state.slice_state`) and every group's hyper-parameters.
        Call it on every rank with the same state; a state saved at another number of ranks, or
        by the plain optimizer, loads alike.

        Raises:
            ValueError: the state's groups differ in number or length from the optimizer's.
        """
        groups = state_dict["param_groups"]
        lengths = [len(g["params"]) for g in groups]
        if lengths != [len(g) for g in self._zero_groups]:
            raise ValueError(f"gradsync: rank {self._zero.rank}: the loaded state has param groups "
                             f"of {lengths} parameters, this optimizer {[len(g) for g in self._zero_groups]}")
        by_position = {self._zero_index[p]: i for i, p in enumerate(self._zero_owned)}
        saved = [i for group in groups for i in group["params"]]  # by position in the optimizer
        local_state = {by_position[n]: slice_state(state_dict["state"][key],
                                                   self._zero.pieces[self._zero_owned[by_position[n]]])
                       for n, key in enumerate(saved) if n in by_position and key in state_dict["state"]}
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

    The parameters are laid out flat in buckets, each split evenly by element over the ranks of
    ``process_set`` (from shapes, dtypes and order alone; a parameter may span owners), and each
    rank keeps optimizer state for its elements only: at most 1/N of it plus one element per
    bucket. This rank's ``param_groups`` list its *shard tensors* (a parameter it owns whole, or a
    flat view of its elements of one) with every group's hyper-parameters, so LR schedulers work.
    When backward returns, ``p.grad`` holds the average of this rank's elements, zeros elsewhere
    (None if it owns nothing of ``p``); ``step()`` updates the shard and allgathers the updated
    elements. N ranks then compute the same update as one process on the N-times larger batch for
    any elementwise optimizer (SGD, Adam, AdamW, RMSprop, Adagrad; not LBFGS, nor LAMB's per-tensor
    norms). Same role as ``torch.distributed.optim.ZeroRedundancyOptimizer``; docs/sharding.md.

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
        bucket_bytes: gradient bytes per reduce-scattered bucket, at least (8 MiB by default; a
            larger parameter is a bucket of its own).
        synchronize_in_backward: as for DistributedOptimizer.

    Raises:
        ValueError: as DistributedOptimizer, ``bucket_bytes < 1``, or a parameter that is not
            contiguous.
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
