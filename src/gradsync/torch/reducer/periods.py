"""The DistributedOptimizer mixin: it tracks *periods*; a strategy does the reduction.

A period runs from one ``step()``, ``zero_grad()`` or closure evaluation to the next. In each
period every rank reduces every parameter exactly once (a round: the strategy's
:meth:`~gradsync.torch.reducer.gradients.GradientReducer.hand_over` from the gradient hooks,
:meth:`~gradsync.torch.reducer.gradients.GradientReducer.finish_round` at the end), so the collectives a
rank submits never depend on its data. This module decides only *when*: counting backward passes
(``backward_passes_per_step``), the end-of-backward callback, closures, ``step`` /
``zero_grad`` / ``synchronize`` / ``skip_synchronize``. Where a round ends is decided in program
order only; docs/architecture.md, "Rank-invariant collectives", lists every decision point.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import logging
import time
import warnings
import weakref
import zlib
from collections.abc import Callable, Iterator

import torch

from ... import ops
from ...process import runtime
from .gradients import GradientReducer
from .parameter_check import warn_if_parameters_differ

log = logging.getLogger("gradsync")


class _Period(enum.Enum):
    """Where this period's gradients stand."""

    OPEN = "open"            # backward passes add gradients; hooks may have started allreduces
    AVERAGED = "averaged"    # the round finished: every gradient holds the average
    DISCARDED = "discarded"  # averaged, then zero_grad(): nothing left to reduce until a new gradient


def unnamed_prefix(param_groups: list[dict]) -> str:
    """The prefix of the names of parameters that ``named_parameters`` does not name (parameter
    ``i`` of group ``g`` is ``<prefix>.<g>.<i>``): ``param.<checksum>``, a CRC-32 of the
    optimizer's parameter layout when it was wrapped (each group's dtypes and shapes in order).
    The same on every rank (the ranks' parameters must match), and apart for two optimizers of
    other layouts in one program: a GAN's generator and discriminator wrapped without names
    would otherwise both reduce ``param.0.0``, in flight at once when one backward pass reaches
    both. Optimizers over parameters of the very same shapes still meet: pass named_parameters."""
    layout = "|".join(";".join(f"{p.dtype}{tuple(p.shape)}" for p in group["params"])
                      for group in param_groups)
    return f"param.{zlib.crc32(layout.encode()):08x}"


class _DistributedOptimizer:
    """Mixed in before the wrapped optimizer's class; see :func:`gradsync.DistributedOptimizer`."""

    def _gradsync_setup(self, named_parameters: dict, backward_passes_per_step: int,
                        strategy: GradientReducer, synchronize_in_backward: bool) -> None:
        """Track every parameter with ``requires_grad`` in ``strategy`` (``named_parameters``:
        parameter -> name, checked already) and start the first period."""
        self._gs_rank = runtime.get().rank
        self._gs_strategy = strategy
        process_set = strategy.reduction.process_set
        self._gs_passes = backward_passes_per_step
        self._gs_in_backward = synchronize_in_backward
        self._gs_synchronized = False  # the user called synchronize() since the last step()
        self._gs_skip = False
        # A rank outside a (registered) process set reduces nothing and steps on its own
        # gradients, as Horovod's: it has no coordinator, and tracks no parameter.
        self._gs_member = process_set.process_set_id is None or process_set.included()
        self._gs_coordinator = runtime.get().coordinator_for(
            process_set, f"gradsync: rank {self._gs_rank}: DistributedOptimizer"
        ) if self._gs_member else None
        self._gs_names = strategy.names  # parameter -> name
        # The hooks hold the optimizer weakly, and go when it goes: a dropped DistributedOptimizer
        # must not keep reducing gradients (nor keep its parameters from a new one).
        self._gs_weak_hook = _weak_hook(weakref.ref(self))
        weakref.finalize(self, _remove_hooks, strategy.hooks)
        self._gs_backward = _BackwardSpan(self._gs_coordinator)
        self._gs_given_names = named_parameters
        self._gs_unnamed = unnamed_prefix(self.param_groups)
        for group in self.param_groups:
            self._gs_check_owners(group)
        for group_index, group in enumerate(self.param_groups):
            self._gs_track(group, group_index)
        strategy.plan()
        self._gs_parameters_checked = False  # the first step() compares the ranks' parameters
        self._gs_warned_no_gradient = False
        self._gs_backward_tasks: set[int] = set()  # backward passes (graph tasks) with our callback
        self._gs_new_period()

    def _gs_check_owners(self, group: dict) -> None:
        """Refuse parameters that another live DistributedOptimizer already reduces: both would
        allreduce the same gradient every step (a silent double count, or a name clash)."""
        for index, param in enumerate(group["params"]):
            owner = getattr(param, "_gradsync_owner", None)
            other = owner() if owner is not None else None
            if other is not None and other is not self and param.requires_grad:
                name = self._gs_given_names.get(param) or other._gs_names.get(param, f"#{index}")
                raise ValueError(
                    f"gradsync: rank {self._gs_rank}: parameter {name!r} is already reduced by another "
                    "DistributedOptimizer; each parameter may belong to one distributed optimizer. "
                    "Give each optimizer disjoint parameters (one optimizer with several param groups "
                    "also works)")

    def _gs_track(self, group: dict, group_index: int) -> None:
        if not self._gs_member:
            return
        for index, param in enumerate(group["params"]):
            if not param.requires_grad or param in self._gs_names:
                continue
            param._gradsync_owner = weakref.ref(self)
            name = self._gs_given_names.get(param, f"{self._gs_unnamed}.{group_index}.{index}")
            self._gs_strategy.attach(param, name, self._gs_weak_hook)

    def _gs_new_period(self) -> None:
        """Start a period: no backward pass counted, no gradient handed over (program order only:
        step(), zero_grad(), a closure evaluation, or a new gradient after an averaged period)."""
        self._gs_period = _Period.OPEN
        self._gs_counts: dict[torch.Tensor, int] = {}  # parameter -> backward passes through it
        self._gs_backward_count = 0  # backward passes of this period that reached the callback

    def _gs_hook(self, param: torch.Tensor) -> None:
        """A gradient of ``param`` was accumulated: count it; on the backward_passes_per_step-th,
        hand it to the strategy; queue the end-of-backward callback once per backward pass."""
        if self._gs_period is not _Period.OPEN:
            self._gs_reopen(param)
        if self._gs_strategy.handed(param):
            raise RuntimeError(self._gs_late_gradient(param, "after its allreduce had started"))
        if self._gs_backward.timeline is not None:
            self._gs_backward.mark(param)
        if self._gs_in_backward:
            self._gs_queue_end_of_backward()
        if self._gs_passes > 1:  # one pass per step needs no count: a second one is refused above
            count = self._gs_counts[param] = self._gs_counts.get(param, 0) + 1
            if count < self._gs_passes:
                return
        self._gs_strategy.hand_over(param)

    def _gs_reopen(self, param: torch.Tensor) -> None:
        """A gradient arrived after the period's round finished. After zero_grad(), or when the
        user dropped the averaged gradient (``model.zero_grad()``, ``p.grad = None``), this is a
        new period; on top of the averaged gradient it would start a second round on the ranks
        with gradients only, so it is refused."""
        if self._gs_period is _Period.AVERAGED and self._gs_strategy.averaged_by_last_round(param):
            raise RuntimeError(self._gs_late_gradient(param, "after this step's gradients were "
                                                             "averaged"))
        self._gs_new_period()

    def _gs_late_gradient(self, param: torch.Tensor, when: str) -> str:
        return (
            f"gradsync: rank {self._gs_rank}: parameter {self._gs_names[param]!r} received a gradient "
            f"{when}: a backward() ran after synchronize() or after the step's last backward "
            f"pass (backward_passes_per_step={self._gs_passes}) without step() or zero_grad() "
            "between. Call optimizer.step() or optimizer.zero_grad() first. If you accumulate "
            "gradients, raise backward_passes_per_step to the number of backward passes per step. "
            "If another loss flows back through this module (a GAN generator's loss through the "
            "discriminator), stop it from producing gradients there: param.requires_grad_(False) "
            "on this module's parameters during that backward, or detach its input.")

    def _gs_queue_end_of_backward(self) -> None:
        """From the first gradient hook of a backward pass: run _gs_end_of_backward when the
        autograd engine finishes that pass (DDP queues its bucket wait the same way)."""
        task = torch._C._current_graph_task_id()
        if task != -1 and task not in self._gs_backward_tasks:
            self._gs_backward_tasks.add(task)
            torch.autograd.Variable._execution_engine.queue_callback(self._gs_end_of_backward)

    def _gs_end_of_backward(self) -> None:
        """Count this backward pass; on the step's last one, wait for the period's allreduces, so
        that backward() returns averaged gradients (on a GPU: the caller's stream waits)."""
        self._gs_backward_tasks.discard(torch._C._current_graph_task_id())
        outer = torch._C._current_autograd_node()
        if outer is not None:  # this pass ran inside a node of another one (reentrant checkpoint)
            self._gs_resume_after(outer)
            return
        self._gs_backward_count += 1
        if self._gs_period is _Period.OPEN and self._gs_backward_count >= self._gs_passes:
            self._gs_synchronize()

    def _gs_resume_after(self, outer) -> None:
        """Queue the end-of-backward callback on the enclosing backward pass instead, from a
        pre-hook on the nodes that pass runs after ``outer`` (one of them always runs: gradients
        flow through a checkpoint only towards inputs that require them)."""
        handles = []

        def resume(grad_outputs):
            for handle in handles:
                handle.remove()
            self._gs_queue_end_of_backward()

        handles += [node.register_prehook(resume) for node, _ in outer.next_functions
                    if node is not None]

    def synchronize(self) -> None:
        """Wait until every gradient of this period is averaged across the ranks, without stepping.

        Starts the allreduce of every parameter whose gradient hook has not (zeros for one
        without a gradient on this rank, its current gradient otherwise), then waits for them all.
        Free when the period is averaged already: after the backward pass that completed the
        step's gradients (with ``synchronize_in_backward=True``, the default), after an earlier
        synchronize(), or after zero_grad() following one. On a GPU it makes the current stream
        wait; the host does not block. Same semantics as Horovod's
        ``DistributedOptimizer.synchronize()``, except that a second call reduces nothing twice;
        a ``step()`` after it outside :meth:`skip_synchronize` gets Horovod's warning. With
        ``op=Adasum``, and on a rank outside the optimizer's process set, it does nothing (as
        Horovod's): step() reduces the update.

        Raises:
            RuntimeError: a gradient was changed in place, or ``p.grad`` replaced, while its
                allreduce was in flight (names the parameter).
            CollectiveError, ShutdownError, RankFailureError: a gradient's collective failed.
        """
        self._gs_synchronized = True
        self._gs_synchronize()

    def _gs_synchronize(self) -> None:
        """End this period's round (see :meth:`synchronize`), unless it has ended, or the strategy
        averages no gradients."""
        if (self._gs_period is not _Period.OPEN or not self._gs_member
                or not self._gs_strategy.averages_gradients):
            return
        self._gs_period = _Period.AVERAGED
        self._gs_warn_once_without_gradients()
        self._gs_backward.write()
        self._gs_strategy.finish_round()

    def _gs_warn_once_without_gradients(self) -> None:
        if (self._gs_warned_no_gradient or self._gs_strategy.reduction.process_set.size() == 1
                or any(p.grad is not None for p in self._gs_names)):
            return
        self._gs_warned_no_gradient = True
        log.warning(
            "gradsync: rank %d: no backward pass since the last step produced a gradient for any of "
            "this optimizer's %d parameters on this rank, so it contributes zeros now, and the "
            "ranks with gradients waited for it at the end of their backward. If code between "
            "backward() and step() reads or changes gradients (clipping, logging, GradScaler), call "
            "optimizer.synchronize() right after backward() on every rank, so that this rank sees "
            "the averaged gradients there too. (Logged once.)", self._gs_rank, len(self._gs_names))

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Within this block ``step()`` does not synchronize. Gradients are averaged when backward()
        returns (by default), and step() after synchronize() reduces nothing again, so this is
        only needed with ``synchronize_in_backward=False``, after an explicit ``synchronize()``
        (Horovod's pattern)::

            loss.backward()
            optimizer.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            with optimizer.skip_synchronize():
                optimizer.step()

        Raises:
            AssertionError: with ``op=Adasum``, whose step() reduces the update itself (Horovod's).
            RuntimeError (from step()): gradients are still in flight (no synchronize() before the
                block).
        """
        self._gs_strategy.allow_skip_synchronize()
        self._gs_skip = True
        try:
            yield
        finally:
            self._gs_skip = False

    def step(self, closure: Callable[[], torch.Tensor] | None = None):
        """Average this period's gradients (unless inside skip_synchronize), then step.

        With ``closure`` (LBFGS, or any optimizer's ``step(closure)``) every evaluation of the
        closure starts a period and ends with :meth:`synchronize`, so the optimizer reads averaged
        gradients, and the closure's returned loss is averaged across the ranks too (reduced like
        the gradients: ``op``), so that an optimizer that compares losses (LBFGS's line search and
        stopping tests) takes the same decisions, and calls the closure as often, on every rank.

        The first call also checks that the ranks hold the same parameters (one small allreduce,
        :func:`gradsync.torch.reducer.parameter_check.warn_if_parameters_differ`), except on a rank whose
        first step comes after a completed ``join()``: the other ranks may have run their check
        while this rank stood in for it, and would never submit it again. After an explicit
        ``synchronize()``, a step() outside ``skip_synchronize()`` gets Horovod's warning
        (gradsync reduces nothing twice). With ``op=Adasum`` the strategy combines the updates
        instead (:class:`gradsync.torch.reducer.strategies.AdasumDeltas`). On a rank outside the
        optimizer's process set: the wrapped optimizer's step on this rank's own gradients
        (Horovod's).

        Raises:
            RuntimeError: step() inside skip_synchronize(), or step(closure), while this rank's
                gradients are still being allreduced; see also :meth:`synchronize`.
        """
        if not self._gs_member:
            return super().step(closure)
        if self._gs_strategy.averages_gradients:
            closure = self._gs_end_period_for_step(closure)
        if not self._gs_parameters_checked:
            self._gs_parameters_checked = True
            if not self._gs_strategy.joined_since_start():
                self._gs_strategy.check_model()  # the same model first (an error), then its values
                warn_if_parameters_differ(self._gs_names, self._gs_strategy.reduction.process_set,
                                          self._gs_rank)
        result = self._gs_strategy.step(super().step, closure)
        self._gs_new_period()
        return result

    def _gs_end_period_for_step(self, closure):
        """Before the wrapped step: Horovod's warning after synchronize(), then end the round
        (or, with a closure, make every evaluation a round of its own)."""
        if self._gs_synchronized and not self._gs_skip:
            warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context "
                          "after optimizer.synchronize(): gradsync does not reduce the gradients "
                          "again, but wrap step() in `with optimizer.skip_synchronize():` to say "
                          "that you meant it", stacklevel=3)
        self._gs_synchronized = False
        if closure is not None:
            self._gs_refuse_in_flight("optimizer.step(closure) was called")
            return functools.partial(self._gs_evaluate, closure)
        if self._gs_skip:
            self._gs_refuse_in_flight("optimizer.step() was called inside skip_synchronize()")
        else:
            self._gs_synchronize()
        return None

    def _gs_evaluate(self, closure: Callable[[], torch.Tensor]):
        """One closure evaluation: a period of its own, averaged, with the loss averaged."""
        self._gs_new_period()  # every rank ended the previous evaluation with a synchronize()
        loss = closure()
        self._gs_synchronize()
        return self._gs_average_loss(loss)

    def _gs_average_loss(self, loss):
        """``loss`` reduced across the ranks in float64, returned as a tensor like ``loss`` (its
        shape, dtype and device) or as a float; every rank gets the same bits. None stays None."""
        value = torch.full((1,), float("nan"), dtype=torch.float64) if loss is None else (
            torch.as_tensor(loss).detach().to("cpu", torch.float64).reshape(-1))
        reduction = self._gs_strategy.reduction
        reduced = ops.allreduce(value, name=f"gradsync.closure_loss.{self._gs_strategy.first_name()}",
                                op=reduction.op, process_set=reduction.process_set)
        if loss is None:
            return None
        if isinstance(loss, torch.Tensor):
            return reduced.reshape(loss.shape).to(loss.device, loss.dtype)
        return reduced.item()

    def _gs_refuse_in_flight(self, what: str) -> None:
        if self._gs_period is _Period.OPEN:
            self._gs_strategy.refuse_in_flight(what)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients (torch semantics) and start a new period.

        After averaged gradients this discards them, as in one process; step() then reduces
        nothing. Gradients still in flight (``synchronize_in_backward=False``) are first
        synchronized, so that every rank finishes the same round.
        """
        if self._gs_period is _Period.OPEN and self._gs_strategy.in_flight():
            self._gs_synchronize()
        super().zero_grad(set_to_none=set_to_none)
        self._gs_strategy.after_zero_grad(set_to_none)
        if self._gs_period is _Period.OPEN:
            self._gs_new_period()  # the passes counted so far are gone
        else:
            self._gs_period = _Period.DISCARDED

    def add_param_group(self, param_group: dict) -> None:
        """Add a param group (torch semantics); its parameters are reduced like the others."""
        super().add_param_group(param_group)
        if hasattr(self, "_gs_names"):
            try:
                self._gs_check_owners(self.param_groups[-1])
            except ValueError:
                self.param_groups.pop()
                raise
            self._gs_track(self.param_groups[-1], len(self.param_groups) - 1)

    @property
    def _parameter_names(self) -> dict:
        """parameter -> its name, for the parameters this optimizer reduces (Horovod's attribute)."""
        return dict(self._gs_names)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Reduce after ``passes`` backward passes from now on, counting afresh (Horovod's method).

        Raises:
            ValueError: ``passes < 1``. RuntimeError: gradients are being reduced (call step() or
                synchronize() first).
        """
        if int(passes) < 1:
            raise ValueError(f"gradsync: rank {self._gs_rank}: backward_passes_per_step must be >= 1, "
                             f"got {passes}")
        if self._gs_strategy.in_flight():
            raise RuntimeError(f"gradsync: rank {self._gs_rank}: set_backward_passes_per_step() while "
                               "gradients are being reduced; call step() or synchronize() first")
        self._gs_passes = int(passes)
        self._gs_counts = {}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load optimizer state (torch semantics), after finishing a round still in flight."""
        if self._gs_period is _Period.OPEN and self._gs_strategy.in_flight():
            self._gs_synchronize()
        super().load_state_dict(state_dict)


class _BackwardSpan:
    """The timeline's BACKWARD span of a step: from the first to the latest gradient hook. On a
    GPU the host runs ahead of the kernels, so the times are timing events recorded on the
    compute stream. ``timeline`` is None when no timeline is written (then nothing is marked)."""

    def __init__(self, coordinator) -> None:
        self.coordinator = coordinator
        self.timeline = coordinator.timeline if coordinator is not None else None
        self.ns = (0, 0)  # first and latest gradient hook of this step, on the host
        self.events = None  # the same on a GPU: (first event, latest event, device index)

    def mark(self, param: torch.Tensor) -> None:
        if param.is_cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            first = self.events[0] if self.events else event
            self.events = (first, event, param.device.index)
            return
        now = time.perf_counter_ns()
        self.ns = (self.ns[0] or now, now)

    def write(self) -> None:
        if self.ns[0]:
            self.timeline.span("backward", "BACKWARD", *self.ns)
            self.ns = (0, 0)
        if self.events is not None:
            from ..device import DEVICE

            first, last, device = self.events
            self.coordinator.device.gpu_span(DEVICE, device, "backward", "BACKWARD", first, last)
            self.events = None


def _weak_hook(ref: weakref.ref) -> Callable[[torch.Tensor], None]:
    def hook(param: torch.Tensor) -> None:
        optimizer = ref()
        if optimizer is not None:
            optimizer._gs_hook(param)
    return hook


def _remove_hooks(hooks: list) -> None:
    for hook in hooks:
        hook.remove()


@functools.cache
def distributed_class(mixin: type, cls: type, prefix: str) -> type:
    """The class of a wrapped optimizer: ``mixin`` before ``cls``, named ``prefix`` + the
    wrapped class's name (cached: every optimizer of one class gets the same class)."""
    return type(f"{prefix}{cls.__name__}", (mixin, cls), {})
