"""One round of gradient collectives, and the contract every reduction strategy keeps.

A *round* reduces every parameter of a DistributedOptimizer exactly once: a gradient hook hands a
parameter over as soon as backward has produced its gradient (:meth:`GradientReducer.hand_over`),
and :meth:`GradientReducer.finish_round` hands over the rest (zeros where this rank has no
gradient), waits for all of them, checks that no gradient changed while it was in flight, and
writes the results. So every rank submits the same collectives per round, whatever its data;
*when* each is submitted differs, which negotiation absorbs. When rounds happen is the
optimizer's business (:mod:`gradsync.torch.reducer.periods`); docs/architecture.md, "Rank-invariant
collectives", gives the rule.

:class:`GradientReducer` holds what every strategy shares (the round, the layout exchange, sparse
gradients, the in-flight check); *which* collectives carry a dense gradient is a strategy's
(:mod:`gradsync.torch.reducer.strategies`, and :class:`gradsync.torch.zero.ShardReducer`), chosen once by
:func:`gradsync.torch.reducer.factory.pick_strategy`.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from ... import ops
from ...compression import Compressor
from ...engine.protocol import ReduceOp
from ...process import runtime
from ...process_sets import ProcessSet
from ..collectives import sparse_allreduce_async
from .parameter_check import check_same_model, parameter_specs

DENSE = 1  # layout codes exchanged between ranks; a sparse gradient is DENSE + its sparse_dim


@dataclass(frozen=True)
class Reduction:
    """How gradients are reduced: the DistributedOptimizer arguments every strategy applies."""

    op: ReduceOp
    prescale: float
    postscale: float
    compression: Compressor
    sparse_as_dense: bool
    process_set: ProcessSet


class HandedOver(NamedTuple):
    """A gradient as it was when its collective started: a later in-place change shows as a larger
    version, a replaced ``p.grad`` as another tensor. (A NamedTuple: one is made per gradient per
    round, and a frozen dataclass's constructor costs several times more.)"""

    grad: torch.Tensor
    version: int


@dataclass
class _Round:
    """One round's collectives: what was handed over, the waits, and what to write afterwards."""

    handed: dict[torch.Tensor, HandedOver] = field(default_factory=dict)
    waits: list[Callable[[], None]] = field(default_factory=list)
    finishes: list[Callable[[], None]] = field(default_factory=list)  # after every wait
    ready: dict[int, int] = field(default_factory=dict)  # group or bucket -> members handed
    resparsify: dict[torch.Tensor, int] = field(default_factory=dict)  # densified -> sparse_dim
    bucket_waits: dict[int, Callable[[], None]] = field(default_factory=dict)  # run in bucket order
    staged: dict[int, list] = field(default_factory=dict)  # bucket -> (member, slot) copied in
    sparse_handed: bool = False  # a sparse gradient was handed over (else every handed one is dense)


class GradientReducer:
    """The base of every reduction strategy: submits, waits for and checks one optimizer's
    gradient collectives, round after round.

    The contract the optimizer (:mod:`gradsync.torch.reducer.periods`) relies on:

    * :meth:`attach` tracks a parameter and, unless the strategy reduces no gradient during
      backward, registers its post-accumulate-grad hook (kept in :attr:`hooks`); :meth:`plan`
      runs once every parameter known at construction is attached;
    * :meth:`hand_over` starts ``param.grad``'s collectives (from the hook, on the
      ``backward_passes_per_step``-th gradient); :meth:`finish_round` ends the round;
    * :meth:`step` runs the wrapped optimizer's step (``run_step``) and whatever the strategy
      adds around it; :meth:`after_zero_grad` follows every ``zero_grad()``;
    * :attr:`averages_gradients`: True if the gradients are averaged in rounds (then the optimizer
      ends a round before each step); False if the strategy reduces something else in
      :meth:`step` (Adasum's updates).

    Here a dense gradient is allreduced alone (in place); sparse ones are allgathered
    (:func:`gradsync.torch.sparse_allreduce_async`) by every strategy. Subclasses change
    :meth:`_ready`, which decides what carries a dense gradient.

    Args:
        reduction: the op, scale factors, compression, sparse handling and process set.
        rank: this process's world rank, for messages.
    """

    averages_gradients = True

    def __init__(self, reduction: Reduction, rank: int) -> None:
        self.reduction = reduction
        self.rank = rank
        self.names: dict[torch.Tensor, str] = {}  # parameter -> name, in the optimizer's order
        self.hooks: list = []  # the hooks' removable handles
        self.rounds = 0  # rounds finished: every rank counts the same (a bucket's step)
        self._round = _Round()
        # The gradients the last round wrote, (parameter, weak reference) in hand-over order; made
        # a dict at the first question only: keying by parameters hashes each one in Python
        # (Tensor.__hash__), which every round would pay for a question asked rarely.
        self._averaged: list | dict[torch.Tensor, weakref.ref] = []
        # The first round first checks that every rank has the same parameters (parameter_check.py);
        # its collectives are named by the order optimizers are created, not by parameter names.
        member = reduction.process_set.process_set_id is not None and reduction.process_set.included()
        self._model_checked = not member
        if member:
            self._model_tag = runtime.get().auto_name("model_check", reduction.process_set.process_set_id)
            self._joins = self._coordinator().joins

    def attach(self, param: torch.Tensor, name: str, on_gradient: Callable[[torch.Tensor], None]) -> None:
        """Track ``param`` as ``name``; ``on_gradient(param)`` runs after each accumulation."""
        self.names[param] = name
        self.hooks.append(param.register_post_accumulate_grad_hook(on_gradient))

    def plan(self) -> None:
        """Called once the parameters known at construction are attached (here: nothing to plan)."""

    def step(self, run_step: Callable, closure: Callable | None):
        """Run the wrapped optimizer's step: ``run_step(closure)``, returning its result."""
        return run_step(closure)

    def after_zero_grad(self, set_to_none: bool) -> None:
        """Called after the wrapped optimizer's ``zero_grad()`` (here: nothing more)."""

    def allow_skip_synchronize(self) -> None:
        """Raise if ``skip_synchronize()`` has no meaning with this strategy (here: it has)."""

    def first_name(self) -> str:
        """The first parameter's name: it tells this optimizer's own collectives apart."""
        return next(iter(self.names.values()), "none")

    def handed(self, param: torch.Tensor) -> bool:
        """True if ``param``'s gradient is part of this round already."""
        return param in self._round.handed

    def in_flight(self) -> list[str]:
        """The names of the gradients handed over in this round, sorted."""
        return sorted(self.names[p] for p in self._round.handed)

    def refuse_in_flight(self, what: str) -> None:
        """Raise RuntimeError naming ``what`` the user did if gradients are in flight."""
        names = self.in_flight()
        if names:
            raise RuntimeError(
                f"gradsync: rank {self.rank}: {what} while the gradients of {len(names)} "
                f"parameter(s) (e.g. {names[0]!r}) are still being allreduced in the background "
                "(synchronize_in_backward=False, or a backward() that failed). Call "
                "optimizer.synchronize() first.")

    def averaged_by_last_round(self, param: torch.Tensor) -> bool:
        """True if ``param.grad`` is the tensor the last finished round wrote (not dropped since)."""
        if isinstance(self._averaged, list):
            self._averaged = dict(self._averaged)
        ref = self._averaged.get(param)
        return ref is not None and ref() is param.grad

    def hand_over(self, param: torch.Tensor) -> None:
        """Start the collective(s) of ``param.grad`` now (it must not be None)."""
        if not self._model_checked:
            self.check_model()
        grad = param.grad
        if grad.layout != torch.strided and self.reduction.sparse_as_dense:
            # The wrapped optimizer gets it sparse again (SparseAdam needs it), as Horovod's.
            self._round.resparsify[param] = grad.sparse_dim()
            param.grad = grad = grad.to_dense()
        self._round.handed[param] = HandedOver(grad, grad._version)
        if grad.layout != torch.strided:
            self._round.sparse_handed = True
            self._round.waits.append(self._sparse_allgather(param, f"grad.{self.names[param]}", grad))
        self._ready(param, grad)

    def _ready(self, param: torch.Tensor, grad: torch.Tensor | None) -> None:
        """``param`` is handed over with ``grad`` (None: no rank has a gradient; sparse: being
        allgathered already): a dense gradient is allreduced alone, in place."""
        if grad is not None and grad.layout == torch.strided:
            self._allreduce(f"grad.{self.names[param]}", grad)

    def finish_round(self) -> None:
        """Hand over every gradient not handed over yet, wait for the whole round, then write the
        results; the next round starts empty.

        Every rank first tells the others which gradients it has, and their layouts (one small
        allreduce per round, :meth:`_exchange_layouts`). A parameter that no rank has a gradient
        for is not reduced, and its ``p.grad`` stays None, as in one process; for any other one a
        rank without a gradient contributes zeros: dense zeros, or no rows where the others'
        gradients are sparse.

        Raises:
            RuntimeError: a gradient changed in place, or ``p.grad`` was replaced, while its
                collective was in flight (named, with the fix), after the whole round finished.
            CollectiveError, ShutdownError, RankFailureError: a collective failed.
        """
        if not self.names:
            return
        self.check_model()
        layouts = self._exchange_layouts()
        handed = self._round.handed
        missing = [p for p in self.names if p not in handed] if len(handed) < len(self.names) else []
        if missing:
            self._hand_over_missing(missing, dict(zip(self.names, ops.synchronize(layouts))))
        else:
            self._round.waits.append(functools.partial(ops.synchronize, layouts))
        done, self._round = self._round, _Round()
        self.rounds += 1
        call_all(done.waits + [done.bucket_waits[i] for i in sorted(done.bucket_waits)])
        self._check_unchanged(done.handed)
        for finish in done.finishes:
            finish()
        for param, sparse_dim in done.resparsify.items():  # sparse_as_dense, after every write
            param.grad = param.grad.to_sparse(sparse_dim)
        self._averaged = [(param, weakref.ref(param.grad)) for param in done.handed]

    def check_model(self) -> None:
        """Once, before this optimizer's first collective: raise CollectiveError on every rank if
        the ranks' parameters differ (:func:`gradsync.torch.reducer.parameter_check.check_same_model`)."""
        if self._model_checked:
            return
        self._model_checked = True
        if self.joined_since_start():
            return  # the others checked while this rank stood in from join(): it would check alone
        check_same_model(parameter_specs((n, p) for p, n in self.names.items()),
                         self.reduction.process_set, self.rank, self._model_tag)

    def joined_since_start(self) -> bool:
        """True if a ``join()`` completed on this rank since the optimizer was built: the other
        ranks may have run their first-round checks while this rank stood in for them, and would
        never submit them again, so this rank skips its own (both checks of parameter_check.py)."""
        return self._coordinator().joins != self._joins

    def _coordinator(self):
        return runtime.get().coordinator_for(self.reduction.process_set, f"gradsync: rank {self.rank}")

    def _exchange_layouts(self):
        """Start the allreduce (Max) of every parameter's gradient layout on this rank (of the
        gradient handed over, if it was): 0 for none, DENSE, or DENSE + sparse_dim for a sparse
        gradient (joined ranks add nothing)."""
        handed = self._round.handed
        if len(handed) == len(self.names) and not self._round.sparse_handed:
            local = np.full(len(handed), DENSE, np.int8)  # the usual round: no per-parameter Python
        else:
            local = np.array([_layout(h.grad if (h := handed.get(p)) is not None else p.grad)
                              for p in self.names], np.int8)
        return ops.allreduce_async(local, name=f"gradsync.gradient_layouts.{self.first_name()}",
                                   op=ReduceOp.Max, process_set=self.reduction.process_set)

    def _hand_over_missing(self, missing: list[torch.Tensor], layouts: dict) -> None:
        for param in missing:
            if layouts[param] == 0:  # no rank has a gradient: nothing to reduce
                self._ready(param, None)
                continue
            if param.grad is None:
                param.grad = _zeros(param, int(layouts[param]) - DENSE)
            self.hand_over(param)

    def _compress(self, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` compressed (its decompression queued for the round's end), or an alias of it."""
        compressed, context = self.reduction.compression.compress(grad)
        if compressed is grad:
            return alias(grad)
        self._round.finishes.append(functools.partial(self._decompress, grad, compressed, context))
        return compressed

    def _allreduce(self, name: str, grad: torch.Tensor) -> None:
        handle = ops.allreduce_async_(self._compress(grad), name=name, op=self.reduction.op,
                                      prescale_factor=self.reduction.prescale,
                                      postscale_factor=self.reduction.postscale,
                                      process_set=self.reduction.process_set)
        self._round.waits.append(functools.partial(ops.synchronize, handle))

    def _decompress(self, grad: torch.Tensor, compressed: torch.Tensor, context) -> None:
        grad.copy_(self.reduction.compression.decompress(compressed, context))

    def _count_ready(self, index: int, members: int) -> bool:
        """Count one more member of group or bucket ``index`` ready; True for its last one."""
        ready = self._round.ready[index] = self._round.ready.get(index, 0) + 1
        return ready == members

    def _sparse_allgather(self, param: torch.Tensor, name: str,
                          grad: torch.Tensor) -> Callable[[], None]:
        """Start the allgathers of a sparse gradient's indices and values
        (:func:`gradsync.torch.sparse_allreduce_async`); the returned wait finishes them and
        queues setting ``param.grad`` to their coalesced sum over the ranks (divided by the number
        of ranks for Average)."""
        result = sparse_allreduce_async(grad.coalesce(), name, self.reduction.op,
                                        self.reduction.process_set)
        finishes = self._round.finishes

        def wait() -> None:
            summed = result()
            finishes.append(lambda: setattr(param, "grad", summed.coalesce()))

        return wait

    def _check_unchanged(self, handed: dict[torch.Tensor, HandedOver]) -> None:
        if all(p.grad is h.grad and h.grad._version == h.version for p, h in handed.items()):
            return
        replaced = [self.names[p] for p, h in handed.items() if p.grad is not h.grad]
        changed = [self.names[p] for p, h in handed.items()
                   if p.grad is h.grad and h.grad._version != h.version]
        what = (f"was changed in place ({', '.join(map(repr, changed[:3]))})" if changed else
                f"was replaced by another tensor, p.grad = ... ({', '.join(map(repr, replaced[:3]))})")
        raise RuntimeError(
            f"gradsync: rank {self.rank}: the gradient of {len(changed) + len(replaced)} "
            f"parameter(s) {what} while its allreduce was in flight, so the average written back "
            "mixes with that change differently on every rank. Change gradients only once they are "
            "averaged: after backward() returns (or after optimizer.synchronize() with "
            "synchronize_in_backward=False), never in a gradient hook or between backward() and "
            "synchronize().")


def _zeros(param: torch.Tensor, sparse_dim: int) -> torch.Tensor:
    """This rank's contribution for a parameter without a gradient: dense zeros, or an empty
    sparse gradient (no rows) of ``sparse_dim`` sparse dimensions."""
    if sparse_dim == 0:
        return torch.zeros_like(param)
    indices = torch.empty((sparse_dim, 0), dtype=torch.int64, device=param.device)
    values = param.new_empty((0, *param.shape[sparse_dim:]))
    return torch.sparse_coo_tensor(indices, values, param.shape, check_invariants=False)


def _layout(grad: torch.Tensor | None) -> int:
    """0 for no gradient, DENSE, or DENSE + sparse_dim for a sparse one."""
    if grad is None:
        return 0
    return DENSE if grad.layout == torch.strided else DENSE + grad.sparse_dim()


def alias(grad: torch.Tensor) -> torch.Tensor:
    """The same memory as ``grad`` under a version counter of its own: gradsync's own writes of
    the result (torch ops on the GPU path) must not look like the user changing the gradient."""
    return grad.new_empty(0).set_(grad)


def call_all(waits: list[Callable[[], None]]) -> None:
    """Call every wait, even after one failed (so that none is left in flight); then raise the
    first error."""
    error = None
    for wait in waits:
        try:
            wait()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            error = error or exc
    if error is not None:
        raise error
