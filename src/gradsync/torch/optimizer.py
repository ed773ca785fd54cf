"""DistributedOptimizer: allreduce gradients while backward runs; averaged when backward returns.

The optimizer works in *periods*: from one ``step()``, ``zero_grad()`` or closure evaluation to the
next. In each period every rank reduces every parameter exactly once (a round,
:class:`gradsync.torch.gradients.GradientReducer`), whether a gradient hook starts its allreduce
during backward or :meth:`synchronize` starts it (with zeros where this rank has no gradient), so
the collectives a rank submits never depend on its data. Where a round ends is decided in program
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
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from .. import adasum, ops, runtime
from ..compression import Compression, Compressor
from ..process_sets import ProcessSet, global_process_set
from ..protocol import ReduceOp
from .comm_hooks import CommHook, CompressedAllreduce
from .gradients import GradientReducer, Reduction

log = logging.getLogger("gradsync")


class _Period(enum.Enum):
    """Where this period's gradients stand."""

    OPEN = "open"            # backward passes add gradients; hooks may have started allreduces
    AVERAGED = "averaged"    # the round finished: every gradient holds the average
    DISCARDED = "discarded"  # averaged, then zero_grad(): nothing left to reduce until a new gradient


class _DistributedOptimizer:
    """Mixed in before the wrapped optimizer's class; see :func:`DistributedOptimizer`."""

    def _gradsync_setup(self, named_parameters, backward_passes_per_step: int,
                        reduction: Reduction, groups: int | list,
                        synchronize_in_backward: bool) -> None:
        self._gs_rank = runtime.get().rank
        self._gs_process_set = process_set = reduction.process_set
        self._gs_size = process_set.size()
        self._gs_op = reduction.op
        # Adasum combines the wrapped optimizer's updates (deltas), not the gradients: see step().
        self._gs_adasum = reduction.op == ReduceOp.Adasum
        self._gs_compression = reduction.compression
        self._gs_passes = backward_passes_per_step
        self._gs_in_backward = synchronize_in_backward
        self._gs_synchronized = False  # the user called synchronize() since the last step()
        # A rank outside a (registered) process set reduces nothing and steps on its own
        # gradients, as Horovod's: it has no coordinator, and tracks no parameter.
        self._gs_member = process_set.process_set_id is None or process_set.included()
        self._gs_coordinator = runtime.get().coordinator_for(
            process_set, f"gradsync: rank {self._gs_rank}: DistributedOptimizer"
        ) if self._gs_member else None
        self._gs_reducer = GradientReducer(reduction, self._gs_rank)
        self._gs_names = self._gs_reducer.names  # parameter -> name
        self._gs_hooks = []
        # The hooks hold the optimizer weakly, and go when it goes: a dropped DistributedOptimizer
        # must not keep reducing gradients (nor keep its parameters from a new one).
        self._gs_weak_hook = _weak_hook(weakref.ref(self))
        weakref.finalize(self, _remove_hooks, self._gs_hooks)
        self._gs_skip = False
        self._gs_timeline = self._gs_coordinator.timeline if self._gs_member else None
        # see _gs_check_parameters_agree
        self._gs_joins = self._gs_coordinator.joins if self._gs_member else 0
        self._gs_backward_ns = (0, 0)  # first and latest gradient hook of this step, for the timeline
        self._gs_backward_events = None  # the same on a GPU: timing events on the compute stream
        self._gs_given_names = _check_names(named_parameters, self._gs_params(), self._gs_rank)
        for group in self.param_groups:
            self._gs_check_owners(group)
        for group_index, group in enumerate(self.param_groups):
            self._gs_track(group, group_index)
        self._gs_reducer.cut_into_groups(groups)
        self._gs_parameters_checked = False  # the first step() compares the ranks' parameters
        self._gs_warned_no_gradient = False
        self._gs_backward_tasks: set[int] = set()  # backward passes (graph tasks) with our callback
        self._gs_new_period()

    def _gs_params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

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
            self._gs_reducer.track(param, self._gs_given_names.get(param, f"param.{group_index}.{index}"))
            if not self._gs_adasum:  # with Adasum gradients accumulate locally; step() reduces
                self._gs_hooks.append(param.register_post_accumulate_grad_hook(self._gs_weak_hook))

    def _gs_new_period(self) -> None:
        """Start a period: no backward pass counted, no gradient handed over (program order only:
        step(), zero_grad(), a closure evaluation, or a new gradient after an averaged period)."""
        self._gs_period = _Period.OPEN
        self._gs_counts: dict[torch.Tensor, int] = {}  # parameter -> backward passes through it
        self._gs_backward_count = 0  # backward passes of this period that reached the callback

    def _gs_hook(self, param: torch.Tensor) -> None:
        """A gradient of ``param`` was accumulated: count it; on the backward_passes_per_step-th,
        start its allreduce; queue the end-of-backward callback once per backward pass."""
        if self._gs_period is not _Period.OPEN:
            self._gs_reopen(param)
        if self._gs_reducer.handed(param):
            raise RuntimeError(self._gs_late_gradient(param, "after its allreduce had started"))
        if self._gs_timeline is not None:
            self._gs_mark_backward(param)
        if self._gs_in_backward:
            self._gs_queue_end_of_backward()
        count = self._gs_counts[param] = self._gs_counts.get(param, 0) + 1
        if count == self._gs_passes:
            self._gs_reducer.hand_over(param)

    def _gs_reopen(self, param: torch.Tensor) -> None:
        """A gradient arrived after the period's round finished. After zero_grad(), or when the
        user dropped the averaged gradient (``model.zero_grad()``, ``p.grad = None``), this is a
        new period; on top of the averaged gradient it would start a second round on the ranks
        with gradients only, so it is refused."""
        if self._gs_period is _Period.AVERAGED and self._gs_reducer.averaged_by_last_round(param):
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

    def _gs_mark_backward(self, param: torch.Tensor) -> None:
        """Timeline: the first and latest gradient of this step. On a GPU the host runs ahead of
        the kernels, so the times are timing events recorded on the compute stream."""
        if param.is_cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            first = self._gs_backward_events[0] if self._gs_backward_events else event
            self._gs_backward_events = (first, event, param.device.index)
            return
        now = time.perf_counter_ns()
        self._gs_backward_ns = (self._gs_backward_ns[0] or now, now)

    def _gs_write_backward(self) -> None:
        if self._gs_backward_ns[0]:
            self._gs_timeline.span("backward", "BACKWARD", *self._gs_backward_ns)
            self._gs_backward_ns = (0, 0)
        if self._gs_backward_events is not None:
            from .device import DEVICE

            first, last, device = self._gs_backward_events
            self._gs_coordinator.device.gpu_span(DEVICE, device, "backward", "BACKWARD", first, last)
            self._gs_backward_events = None

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
        """End this period's round (see :meth:`synchronize`), unless it has ended."""
        if self._gs_period is not _Period.OPEN or self._gs_adasum or not self._gs_member:
            return
        self._gs_period = _Period.AVERAGED
        self._gs_warn_once_without_gradients()
        self._gs_write_backward()
        self._gs_reducer.finish_round()

    def _gs_warn_once_without_gradients(self) -> None:
        if (self._gs_warned_no_gradient or self._gs_size == 1
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
        if self._gs_adasum:
            raise AssertionError("gradsync: skip_synchronize() has no meaning with op=Adasum: step() "
                                 "reduces the wrapped optimizer's update itself; call step() alone")
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

        The first call also checks that the ranks hold the same parameters (one small allreduce);
        see :meth:`_gs_check_parameters_agree`. After an explicit ``synchronize()``, a step()
        outside ``skip_synchronize()`` gets Horovod's warning (gradsync reduces nothing twice).
        With ``op=Adasum``: see :meth:`_gs_adasum_step`. On a rank outside the optimizer's process
        set: the wrapped optimizer's step on this rank's own gradients (Horovod's).

        Raises:
            RuntimeError: step() inside skip_synchronize(), or step(closure), while this rank's
                gradients are still being allreduced; see also :meth:`synchronize`.
        """
        if not self._gs_member:
            return super().step(closure)
        if self._gs_synchronized and not (self._gs_skip or self._gs_adasum):
            warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context "
                          "after optimizer.synchronize(): gradsync does not reduce the gradients "
                          "again, but wrap step() in `with optimizer.skip_synchronize():` to say "
                          "that you meant it", stacklevel=2)
        self._gs_synchronized = False
        if self._gs_adasum:
            return self._gs_adasum_step(closure)
        if closure is not None:
            self._gs_refuse_in_flight("optimizer.step(closure) was called")
            closure = functools.partial(self._gs_evaluate, closure)
        elif self._gs_skip:
            self._gs_refuse_in_flight("optimizer.step() was called inside skip_synchronize()")
        else:
            self._gs_synchronize()
        self._gs_check_parameters_once()
        result = super().step(closure)
        self._gs_new_period()
        return result

    def _gs_check_parameters_once(self) -> None:
        if not self._gs_parameters_checked:
            self._gs_parameters_checked = True
            self._gs_check_parameters_agree()

    def _gs_adasum_step(self, closure):
        """Horovod's Adasum optimizer: the wrapped optimizer steps on this rank's own (locally
        accumulated) gradients, and closure losses stay this rank's own; the update of every
        parameter (its change, learning rate and momentum included) is combined across ranks by
        Adasum, and every rank applies the combined update to its parameters as they were before
        the step. One grouped Adasum allreduce per dtype (after ``compression``), on host memory
        (CUDA tensors are staged); every rank submits them whatever its gradients (a parameter
        without one has a zero update)."""
        from .collectives import grouped_allreduce_async_

        self._gs_check_parameters_once()
        params = list(self._gs_names)
        with torch.no_grad():
            start = [p.detach().clone() for p in params]
        loss = super().step(closure)
        by_dtype: dict[torch.dtype, list[_AdasumUpdate]] = {}
        with torch.no_grad():
            for param, before in zip(params, start):
                param.sub_(before)  # the update, reduced in the parameter's own memory
                compressed, context = self._gs_compression.compress(param.detach())
                by_dtype.setdefault(compressed.dtype, []).append(
                    _AdasumUpdate(param, compressed, context, before))
            handles = [grouped_allreduce_async_([u.compressed for u in updates], op=ReduceOp.Adasum,
                                                name=f"adasum.{self._gs_reducer.first_name()}.{dtype}",
                                                process_set=self._gs_process_set)
                       for dtype, updates in by_dtype.items()]
            for handle in handles:
                ops.synchronize(handle)
            for update in (u for updates in by_dtype.values() for u in updates):
                update.param.copy_(update.before + self._gs_compression.decompress(
                    update.compressed, update.context))
        self._gs_new_period()
        return loss

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
        name = f"gradsync.closure_loss.{self._gs_reducer.first_name()}"
        reduced = ops.allreduce(value, name=name, op=self._gs_op, process_set=self._gs_process_set)
        if loss is None:
            return None
        if isinstance(loss, torch.Tensor):
            return reduced.reshape(loss.shape).to(loss.device, loss.dtype)
        return reduced.item()

    def _gs_refuse_in_flight(self, what: str) -> None:
        names = self._gs_reducer.in_flight()
        if self._gs_period is _Period.OPEN and names:
            raise RuntimeError(
                f"gradsync: rank {self._gs_rank}: {what} while the gradients of {len(names)} "
                f"parameter(s) (e.g. {names[0]!r}) are still being allreduced in the background "
                "(synchronize_in_backward=False, or a backward() that failed). Call "
                "optimizer.synchronize() first.")

    def _gs_check_parameters_agree(self) -> None:
        """Warn, from the process set's first rank, when the ranks' parameters differ before the
        first update: the most common silent mistake (no ``broadcast_parameters`` after building a
        model with a rank-dependent or unseeded initialisation). Every rank would then apply the
        same averaged update to different weights, and the ranks would never agree.

        Each parameter's bits are summed as integers (exact, and the same whatever the order of
        the sum, so equal parameters always compare equal) and compared by one allreduce (Max of
        ``[sums, -sums]``, 16 bytes per parameter) on the optimizer's process set. A warning, not
        an error: DDP copies rank 0's parameters at construction, Horovod leaves it to the user.

        Skipped on a rank whose first step comes after a completed ``join()``: the other ranks
        may have run their check while this rank stood in for it, and would never submit it again.
        """
        params = list(self._gs_names)
        if self._gs_size == 1 or not params or self._gs_coordinator.joins != self._gs_joins:
            return
        n = len(params)
        sums = np.empty(n, np.int64)
        by_device: dict[torch.device, list[int]] = {}
        for i, param in enumerate(params):
            by_device.setdefault(param.device, []).append(i)
        with torch.no_grad():
            for indices in by_device.values():  # one copy to the host per device
                sums[indices] = torch.stack([_bit_sum(params[i]) for i in indices]).cpu().numpy()
        top = ops.allreduce(np.concatenate([sums, -sums]), op=ReduceOp.Max,
                            name=f"gradsync.parameter_check.{self._gs_names[params[0]]}",
                            process_set=self._gs_process_set)
        differ = [self._gs_names[params[i]] for i in range(n) if top[i] != -top[n + i]]  # max != min
        if differ and self._gs_process_set.rank() == 0:
            where = "root_rank=0"
            if self._gs_process_set.process_set_id != 0:
                where = (f"root_rank={self._gs_process_set.ranks[0]}, process_set=<this optimizer's "
                         f"{self._gs_process_set}>")
            log.warning(
                "gradsync: rank %d: the ranks hold different parameters at the first step(): %d of "
                "%d differ, e.g. %s. Every rank would apply the same averaged update to different "
                "weights, and they would never agree. Call gradsync.broadcast_parameters("
                "model.state_dict(), %s) once before training (and "
                "gradsync.broadcast_optimizer_state(optimizer, %s) when resuming).",
                self._gs_rank, len(differ), n, ", ".join(map(repr, differ[:3])), where, where)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients (torch semantics) and start a new period.

        After averaged gradients this discards them, as in one process; step() then reduces
        nothing. Gradients still in flight (``synchronize_in_backward=False``) are first
        synchronized, so that every rank finishes the same round.
        """
        if self._gs_period is _Period.OPEN and self._gs_reducer.in_flight():
            self._gs_synchronize()
        super().zero_grad(set_to_none=set_to_none)
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
        if self._gs_reducer.in_flight():
            raise RuntimeError(f"gradsync: rank {self._gs_rank}: set_backward_passes_per_step() while "
                               "gradients are being reduced; call step() or synchronize() first")
        self._gs_passes = int(passes)
        self._gs_counts = {}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load optimizer state (torch semantics), after finishing a round still in flight."""
        if self._gs_period is _Period.OPEN and self._gs_reducer.in_flight():
            self._gs_synchronize()
        super().load_state_dict(state_dict)


@dataclass(frozen=True)
class _AdasumUpdate:
    """One parameter's update in an Adasum step: reduced in ``compressed``, added to ``before``."""

    param: torch.Tensor
    compressed: torch.Tensor
    context: object
    before: torch.Tensor


_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32}


def _bit_sum(param: torch.Tensor) -> torch.Tensor:
    """The sum of ``param``'s bits read as integers (int64, on its device): equal tensors give equal
    sums, exactly, in any order of summation; 8- and 16-byte elements are read as int32 words."""
    flat = param.detach().contiguous().reshape(-1)
    return flat.view(_INT_OF_SIZE.get(flat.element_size(), torch.int32)).sum(dtype=torch.int64)


def _weak_hook(ref: weakref.ref) -> Callable[[torch.Tensor], None]:
    def hook(param: torch.Tensor) -> None:
        optimizer = ref()
        if optimizer is not None:
            optimizer._gs_hook(param)
    return hook


def _remove_hooks(hooks: list) -> None:
    for hook in hooks:
        hook.remove()


def _check_names(named_parameters, params: list[torch.Tensor], rank: int) -> dict:
    """Map parameter -> given name, checking for duplicate and missing names."""
    if named_parameters is None:
        return {}
    pairs = list(named_parameters)
    if any(not (isinstance(pair, tuple) and len(pair) == 2) for pair in pairs):
        raise ValueError(f"gradsync: rank {rank}: named_parameters must be (name, parameter) pairs, "
                         "as model.named_parameters() gives")
    names = [name for name, _ in pairs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"gradsync: rank {rank}: named_parameters has duplicate names: {duplicates}")
    given = {param: name for name, param in pairs}
    missing = [i for i, p in enumerate(params) if p not in given]
    if missing:
        raise ValueError(
            f"gradsync: rank {rank}: {len(missing)} optimizer parameter(s) have no name in "
            f"named_parameters (positions {missing[:10]} in the optimizer's parameter list); pass "
            "the named_parameters() of the module that owns every optimized parameter")
    return given


@functools.cache
def _distributed_class(cls: type) -> type:
    return type(f"Distributed{cls.__name__}", (_DistributedOptimizer, cls), {})


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                         compression: Compressor = Compression.none,
                         backward_passes_per_step: int = 1, op: ReduceOp = ReduceOp.Average,
                         gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups: int | list[list[torch.Tensor]] | None = None,
                         sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set,
                         synchronize_in_backward: bool = True,
                         comm_hook: CommHook | None = None,
                         gradient_as_bucket_view: bool | None = None) -> torch.optim.Optimizer:
    """Make ``optimizer`` data-parallel: gradients are allreduced while backward runs.

    A post-accumulate-grad hook on every parameter with ``requires_grad`` starts an asynchronous
    in-place allreduce of its gradient as soon as backward has produced it, so communication
    overlaps the rest of backward. The backward pass that completes a step's gradients waits for
    them before it returns (as DDP does), so code between ``backward()`` and ``step()`` (gradient
    clipping, norm logging, ``GradScaler.unscale_``) sees the averaged gradients; ``step()`` then
    runs the wrapped optimizer's step. With ``op=Average`` and equal per-rank batches, N ranks
    compute the same update as one process on the N-times larger batch (same semantics, and the
    same argument order, as Horovod's ``hvd.DistributedOptimizer``; ``synchronize_in_backward``
    is gradsync's own, after Horovod's arguments).

    Every rank reduces every parameter once per step whatever its data: a rank whose backward
    produced no gradient for a parameter (an unused branch, a loss not connected to the
    parameters) contributes zeros at ``step()`` (or ``synchronize()``), so no rank waits forever.
    ``step(closure)`` averages the gradients and the loss of every closure evaluation (LBFGS).
    docs/getting-started.md, "What you can do after backward()", has the whole contract.

    The first ``step()`` also compares the ranks' parameters (one small allreduce) and logs a
    warning naming those that differ: the usual sign of a missing
    :func:`gradsync.broadcast_parameters`.

    The optimizer is wrapped *in place* (its class becomes a subclass that adds synchronisation)
    and returned, so its state, param groups and any reference to it stay valid. Create LR
    schedulers after wrapping.

    Args:
        optimizer: any ``torch.optim.Optimizer`` over host (CPU) or CUDA parameters (one GPU per
            rank; see docs/gpu.md).
        named_parameters: ``model.named_parameters()``; names identify gradients across ranks and
            appear in errors. Without it, parameters are named by position ("param.<group>.<index>").
        compression: how gradients travel: ``gradsync.Compression.none`` (default), ``.fp16`` or
            ``.bf16`` (float32/float64 gradients are cast to 16 bits before fusion and back after
            the allreduce), or any object with ``compress``/``decompress``
            (:class:`gradsync.compression.Compressor`). Sparse gradients are not compressed.
        backward_passes_per_step: backward passes accumulated locally before the allreduce
            (gradient accumulation); gradients are summed over the passes, as in plain PyTorch.
        op: ``Average`` (default) or ``Sum`` of the gradients across ranks, or ``Adasum``: then
            the wrapped optimizer steps on each rank's own gradients and the *updates* are
            combined by Adasum (:meth:`_DistributedOptimizer._gs_adasum_step`; a power-of-two
            number of ranks), as Horovod's Adasum optimizer; gradients stay this rank's own.
        gradient_predivide_factor: with Average, gradients are multiplied by 1/f before the sum and
            by f/size after it (to keep low-precision sums in range).
        num_groups: as ``groups=N`` (Horovod's older name for it).
        groups: None or 0 (default): each gradient is allreduced on its own as soon as it is
            ready (and fused with others that happen to be ready at the same time). An int N > 0:
            the parameters, in the optimizer's order, are cut into N groups as evenly as possible.
            A list of lists of parameters: those groups (parameters in none are reduced on their
            own). Each group is reduced by one :func:`gradsync.grouped_allreduce_async_` (per
            gradient dtype) once all its gradients are ready: fewer, larger, predictable fusion
            buffers, as Horovod's ``groups``. Parameters added later with ``add_param_group`` are
            reduced on their own.
        sparse_as_dense: sparse gradients (``nn.Embedding(sparse=True)``) are densified,
            allreduced like the others, and made sparse again when the round ends (as Horovod's,
            so ``SparseAdam`` still gets sparse gradients). By default they are reduced by
            :func:`gradsync.torch.sparse_allreduce_async` (an allgather of their indices and
            values), and ``param.grad`` becomes the coalesced sparse sum (divided by the number
            of ranks for Average): cheaper when few rows are touched. A rank on which such a
            parameter got no gradient in a step contributes no rows.
        process_set: the ranks among which gradients are averaged (default: every rank); Average
            divides by its size. On a rank outside it the optimizer reduces nothing and steps on
            that rank's own gradients (as Horovod's).
        synchronize_in_backward: True (default): the step's last backward pass waits for its
            allreduces before returning (on a GPU, the current stream waits; the host does not).
            False: Horovod's timing: ``step()`` or ``synchronize()`` waits, and gradients must not
            be read or changed before (an in-place change or a replaced ``p.grad`` raises there).
        comm_hook: None (default): each gradient of ``GRADSYNC_SMALL_GRADIENT_BYTES`` (256 KiB)
            or more is allreduced on its own, as above; smaller ones are copied into buckets
            (reverse parameter order, per (device, dtype), up to 25 MiB or the fusion threshold if
            larger), one allreduce per bucket, the results copied back: the same numbers, fewer
            collectives (not with ``gradient_as_bucket_view``, ``groups``/``num_groups``, a
            ``compression`` or ``op=Adasum``: then every gradient alone; docs/comm-hooks.md). A
            communication hook (:mod:`gradsync.torch.comm_hooks`; docs/comm-hooks.md): the
            parameters are cut into buckets (by (device, dtype), in reverse order, up to the fusion
            threshold, or the ``groups`` / ``num_groups`` groups), and each bucket, once all its
            gradients are ready, is handed to ``comm_hook(bucket)`` as one flat buffer:
            :func:`gradsync.allreduce_hook`, :func:`gradsync.fp16_compress_hook`,
            :func:`gradsync.bf16_compress_hook`, :class:`gradsync.PowerSGD`, or your own.
            Sparse gradients are still allgathered on their own. Not with ``compression``,
            ``gradient_predivide_factor`` (a hook replaces both) or ``op=Adasum``.
        gradient_as_bucket_view: each ``p.grad`` is a view into its bucket's buffer, so autograd
            accumulates straight into it and the bucket is reduced in place with no copy (DDP's
            ``gradient_as_bucket_view``); a gradient that is not the view (after
            ``zero_grad(set_to_none=True)``, or a replaced ``p.grad``) is copied in once and
            ``p.grad`` re-pointed at the view. None (default): True with a ``comm_hook``, else
            False (and small gradients copied into buckets, above). True without a hook buckets
            the gradients with the default allreduce
            (``compression`` and ``gradient_predivide_factor`` apply to each bucket). False with a
            hook: gradients are copied into the buckets and the results copied back.

    Raises:
        ValueError: a parameter already reduced by another DistributedOptimizer (named), duplicate
            names or names that are not (name, tensor) pairs (checked before anything else, also
            before ``gradsync.init()``), optimizer parameters missing from ``named_parameters``,
            ``backward_passes_per_step < 1``, ``groups`` / ``num_groups`` that are neither an int
            >= 0 nor lists of parameters (or both given, differently), a predivide factor with an op
            other than Average, an op other than Average, Sum and Adasum, an optimizer that is
            already distributed, or one whose ``step`` an LR scheduler created before wrapping has
            already replaced; a ``process_set`` that is not registered.
        NotImplementedError: ``op=Adasum`` on a process set whose size is not a power of two.
        TypeError: ``compression`` has no ``compress``/``decompress`` methods; ``comm_hook`` is
            not callable; later (from backward()/synchronize()), a hook's ``wait()`` returned
            something else than the bucket's flat tensor.
        ValueError (also): ``comm_hook`` with ``compression``, ``gradient_predivide_factor`` or
            ``op=Adasum``.
        NotInitializedError: before ``gradsync.init()``.
        RuntimeError: later, from ``backward()``, ``synchronize()`` or ``step()``: a gradient
            changed in place or ``p.grad`` replaced while its allreduce was in flight; a backward
            pass after the step's gradients were averaged, without ``step()`` or ``zero_grad()``
            between. The message names the parameter and the fix.
    """
    if named_parameters is not None:
        named_parameters = list(named_parameters)
        # Checked before anything else, as Horovod does (also before init: the rank may be unknown).
        _check_names(named_parameters, [], runtime.get().rank if runtime.is_initialized() else "?")
    rank = runtime.get().rank
    op, groups = _check_arguments(optimizer, rank, backward_passes_per_step, op,
                                  gradient_predivide_factor, num_groups, groups, compression,
                                  process_set)
    _check_hook(rank, comm_hook, compression, gradient_predivide_factor, op)
    original = type(optimizer)
    optimizer.__class__ = _distributed_class(original)
    try:
        views = comm_hook is not None if gradient_as_bucket_view is None else bool(gradient_as_bucket_view)
        prescale, postscale = 1.0 / float(gradient_predivide_factor), float(gradient_predivide_factor)
        config = runtime.get().config
        below = _small_gradient_buckets(config, comm_hook, gradient_as_bucket_view, op, groups,
                                        compression)
        if comm_hook is None and (views or below) and op != ReduceOp.Adasum:
            comm_hook = CompressedAllreduce(compression, prescale, postscale)
        reduction = Reduction(op, prescale, postscale, compression, bool(sparse_as_dense),
                              process_set, comm_hook=comm_hook, bucket_views=views and comm_hook is not None,
                              bucket_bytes=(max(config.fusion_threshold, SMALL_GRADIENT_BUCKET_BYTES)
                                            if below else config.fusion_threshold),
                              bucket_below=below)
        optimizer._gradsync_setup(named_parameters, int(backward_passes_per_step), reduction,
                                  groups, bool(synchronize_in_backward))
    except BaseException:
        optimizer.__class__ = original  # a failed wrap leaves the optimizer as it was
        raise
    return optimizer


# The capacity of the default's small-gradient buckets: DDP's bucket_cap_mb (25 MB), or the fusion
# threshold if larger. Fewer, larger buckets beat 1 MiB ones for the 291-gradient transformer of
# benchmarks/train_step.py (docs/benchmarks.md); a larger gradient is allreduced alone anyway.
SMALL_GRADIENT_BUCKET_BYTES = 25 << 20


def _small_gradient_buckets(config, comm_hook, gradient_as_bucket_view, op, groups,
                            compression) -> int:
    """The size (bytes) below which the default reduction copies gradients into buckets
    (``GRADSYNC_SMALL_GRADIENT_BYTES``), or 0 where each gradient is allreduced alone: a hook or
    ``gradient_as_bucket_view`` chosen (they bucket every gradient), reduction groups (Horovod's
    ``groups``, which say how to fuse), Adasum (per tensor), a compression (applied per tensor),
    or fusion off (``GRADSYNC_FUSION_THRESHOLD=0``, which also caps the buckets)."""
    if (comm_hook is not None or gradient_as_bucket_view is not None or op == ReduceOp.Adasum
            or groups or compression is not Compression.none or config.fusion_threshold <= 0):
        return 0
    return max(0, config.small_gradient_bytes)


def _check_hook(rank: int, comm_hook, compression, gradient_predivide_factor, op) -> None:
    """Refuse a ``comm_hook`` that is not callable or comes with what it replaces."""
    if comm_hook is None:
        return
    if not callable(comm_hook):
        raise TypeError(f"gradsync: rank {rank}: comm_hook={comm_hook!r} is not callable; pass a "
                        "function hook(bucket) -> future (see gradsync.allreduce_hook)")
    if compression is not Compression.none or gradient_predivide_factor != 1.0:
        raise ValueError(f"gradsync: rank {rank}: comm_hook={comm_hook!r} reduces the buckets "
                         f"itself; drop compression={compression!r} and gradient_predivide_factor="
                         f"{gradient_predivide_factor} (use gradsync.fp16_compress_hook for fp16)")
    if ReduceOp(op) == ReduceOp.Adasum:
        raise ValueError(f"gradsync: rank {rank}: comm_hook={comm_hook!r} with op=Adasum: Adasum "
                         "combines the ranks' updates, not their gradients; use one or the other")


def _check_arguments(optimizer, rank: int, backward_passes_per_step, op, gradient_predivide_factor,
                     num_groups, groups, compression, process_set) -> tuple[ReduceOp, int | list]:
    """Refuse what DistributedOptimizer cannot do (see its Raises); returns the op (Average for
    Adasum on one rank, as Horovod) and the groups (an int, 0 for none, or lists)."""
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError(f"gradsync: rank {rank}: this optimizer is already a DistributedOptimizer")
    if "step" in vars(optimizer):
        raise ValueError(
            f"gradsync: rank {rank}: optimizer.step has been replaced on this optimizer object (an "
            "LR scheduler created before wrapping does this), so gradients would not be averaged; "
            "wrap the optimizer with gradsync.DistributedOptimizer before creating LR schedulers")
    if int(backward_passes_per_step) < 1:
        raise ValueError(f"gradsync: rank {rank}: backward_passes_per_step must be >= 1, got "
                         f"{backward_passes_per_step}")
    if not _is_count(num_groups):
        raise ValueError(f"gradsync: rank {rank}: num_groups must be an int >= 0 (0: no groups), "
                         f"got {num_groups!r}")
    if groups is not None and not (isinstance(groups, list) or _is_count(groups)):
        raise ValueError(f"gradsync: rank {rank}: groups must be an int >= 0 (0: no groups) or a "
                         f"list of lists of parameters, got {groups!r}")
    if num_groups and groups is not None and groups != num_groups:
        raise ValueError(f"gradsync: rank {rank}: give groups= or num_groups= (its older name), not "
                         f"both: groups={groups!r}, num_groups={num_groups!r}")
    op = ReduceOp(op)
    if op not in (ReduceOp.Average, ReduceOp.Sum, ReduceOp.Adasum):
        raise ValueError(f"gradsync: rank {rank}: DistributedOptimizer reduces gradients with "
                         f"Average, Sum or Adasum, got {op.name}")
    if gradient_predivide_factor != 1.0 and op != ReduceOp.Average:
        raise ValueError(f"gradsync: rank {rank}: gradient_predivide_factor="
                         f"{gradient_predivide_factor} needs op=Average, got {op.name}")
    if op == ReduceOp.Adasum:
        adasum.check_ranks(process_set.size(), f"gradsync: rank {rank}: {process_set}")
    if not (callable(getattr(compression, "compress", None))
            and callable(getattr(compression, "decompress", None))):
        raise TypeError(f"gradsync: rank {rank}: compression={compression!r} needs compress() and "
                        "decompress() methods (see gradsync.Compression)")
    if op == ReduceOp.Adasum and process_set.size() == 1:
        op = ReduceOp.Average
    return op, num_groups if groups is None else groups


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
