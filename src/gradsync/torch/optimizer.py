"""DistributedOptimizer: allreduce gradients while backward runs, step once they are averaged."""

from __future__ import annotations

import contextlib
import functools
import logging
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import torch

from .. import ops, runtime
from ..compression import Compression, Compressor
from ..fusion import split_rows
from ..process_sets import ProcessSet, global_process_set
from ..protocol import ReduceOp

log = logging.getLogger("gradsync")


class _DistributedOptimizer:
    """Mixed in before the wrapped optimizer's class; see :func:`DistributedOptimizer`."""

    def _gradsync_setup(self, named_parameters, backward_passes_per_step: int, op: ReduceOp,
                        gradient_predivide_factor: float, sparse_as_dense: bool,
                        compression: Compressor, process_set: ProcessSet,
                        groups: int | list = 0) -> None:
        self._gs_rank = runtime.get().rank
        self._gs_process_set = process_set
        self._gs_size = process_set.size()
        self._gs_compression = compression
        self._gs_sparse_as_dense = sparse_as_dense
        self._gs_op = op
        # Adasum combines the wrapped optimizer's updates (deltas), not the gradients: see step().
        self._gs_adasum = op == ReduceOp.Adasum
        self._gs_synchronized = False  # synchronize() called since the last step()
        self._gs_densified: list[torch.Tensor] = []  # sparse_as_dense: back to sparse after the sum
        self._gs_prescale = 1.0 / gradient_predivide_factor
        self._gs_postscale = gradient_predivide_factor
        self._gs_passes = backward_passes_per_step
        self._gs_names: dict[torch.Tensor, str] = {}
        self._gs_counts: dict[torch.Tensor, int] = {}
        self._gs_handles: dict[torch.Tensor, Callable[[], None]] = {}  # param -> wait for its grad
        self._gs_hooks = []
        # The hooks hold the optimizer weakly, and go when it goes: a dropped DistributedOptimizer
        # must not keep reducing gradients (nor keep its parameters from a new one).
        self._gs_weak_hook = _weak_hook(weakref.ref(self))
        weakref.finalize(self, _remove_hooks, self._gs_hooks)
        self._gs_skip = False
        # A rank outside a (registered) process set reduces nothing and steps on its own
        # gradients, as Horovod's: it has no coordinator, and tracks no parameter.
        member = process_set.process_set_id is None or process_set.included()
        self._gs_coordinator = runtime.get().coordinator_for(
            process_set, f"gradsync: rank {self._gs_rank}: DistributedOptimizer") if member else None
        self._gs_timeline = self._gs_coordinator.timeline if member else None
        self._gs_joins = self._gs_coordinator.joins if member else 0  # see _gs_check_parameters_agree
        self._gs_backward_ns = (0, 0)  # first and latest gradient hook of this step, for the timeline
        self._gs_backward_events = None  # the same on a GPU: timing events on the compute stream
        self._gs_given_names = _check_names(named_parameters, self._gs_params(), self._gs_rank)
        for group in self.param_groups:
            self._gs_check_owners(group)
        for group_index, group in enumerate(self.param_groups):
            self._gs_track(group, group_index)
        self._gs_group_of = _reduction_groups(list(self._gs_names), groups, self._gs_rank)
        self._gs_group_ready: dict[int, int] = {}  # reduction group -> its parameters submitted
        self._gs_parameters_checked = False  # the first step() compares the ranks' parameters

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
        if self._gs_coordinator is None:  # not a member of the process set
            return
        for index, param in enumerate(group["params"]):
            if not param.requires_grad or param in self._gs_names:
                continue
            name = self._gs_given_names.get(param, f"param.{group_index}.{index}")
            param._gradsync_owner = weakref.ref(self)
            self._gs_names[param] = name
            self._gs_counts[param] = 0
            self._gs_hooks.append(param.register_post_accumulate_grad_hook(self._gs_weak_hook))

    def _gs_hook(self, param: torch.Tensor) -> None:
        if self._gs_adasum:  # gradients accumulate locally; step() reduces the update
            return
        name = self._gs_names[param]
        if param in self._gs_handles:
            raise RuntimeError(
                f"gradsync: rank {self._gs_rank}: parameter {name!r} received a gradient after its "
                f"allreduce had started: more backward passes ran through it before step() than "
                f"backward_passes_per_step={self._gs_passes}. If you accumulate gradients, raise "
                "backward_passes_per_step to the number of backward passes per step. If another loss "
                "flows back through this module (a GAN generator's loss through the discriminator), "
                "stop it from producing gradients there: param.requires_grad_(False) on this module's "
                "parameters during that backward, or detach its input.")
        if self._gs_timeline is not None:
            self._gs_mark_backward(param)
        self._gs_counts[param] += 1
        if self._gs_counts[param] == self._gs_passes:
            self._gs_submit(param)

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

    def _gs_submit(self, param: torch.Tensor) -> None:
        name = f"grad.{self._gs_names[param]}"
        if param.grad.layout != torch.strided:
            if not self._gs_sparse_as_dense:
                self._gs_handles[param] = self._gs_sparse_allgather(param, name)
                if param in self._gs_group_of:  # reduced apart, but its group waits for it too
                    self._gs_handles[param] = functools.partial(
                        _call_all, [self._gs_handles[param], self._gs_group_submit(param)])
                return
            param.grad = param.grad.to_dense()
            self._gs_densified.append(param)  # the wrapped optimizer gets it sparse again
        if param in self._gs_group_of:
            self._gs_handles[param] = self._gs_group_submit(param)
            return
        compressed, context = self._gs_compression.compress(param.grad)
        handle = ops.allreduce_async_(compressed, name=name, op=self._gs_op,
                                      prescale_factor=self._gs_prescale,
                                      postscale_factor=self._gs_postscale,
                                      process_set=self._gs_process_set)
        if compressed is param.grad:
            self._gs_handles[param] = functools.partial(ops.synchronize, handle)
            return

        def finish() -> None:  # decompress after the allreduce, into the gradient itself
            param.grad.copy_(self._gs_compression.decompress(ops.synchronize(handle), context))

        self._gs_handles[param] = finish

    def _gs_group_submit(self, param: torch.Tensor) -> Callable[[], None]:
        """Count ``param`` ready in its reduction group; when it is the group's last, start one
        grouped allreduce per gradient dtype and return the wait for them (else a no-op)."""
        index, members = self._gs_group_of[param]
        ready = self._gs_group_ready[index] = self._gs_group_ready.get(index, 0) + 1
        if ready < len(members):
            return _nothing
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        decompress = []  # (gradient, what travelled, context) of the compressed members
        for member in members:  # sparse gradients went their own way (allgather)
            if member.grad.layout == torch.strided:
                compressed, context = self._gs_compression.compress(member.grad)
                by_dtype.setdefault(compressed.dtype, []).append(compressed)
                if compressed is not member.grad:
                    decompress.append((member.grad, compressed, context))
        handles = [ops.grouped_allreduce_async_(grads, name=f"grad.group.{index}.{dtype}",
                                                op=self._gs_op, prescale_factor=self._gs_prescale,
                                                postscale_factor=self._gs_postscale,
                                                process_set=self._gs_process_set)
                   for dtype, grads in by_dtype.items()]

        def finish() -> None:
            _call_all([functools.partial(ops.synchronize, h) for h in handles])
            for grad, compressed, context in decompress:
                grad.copy_(self._gs_compression.decompress(compressed, context))

        return finish

    def _gs_sparse_allgather(self, param: torch.Tensor, name: str) -> Callable[[], None]:
        """Start the allgather of a sparse gradient's indices and values; the returned function
        waits and sets param.grad to their coalesced sum over ranks (divided by size for Average)."""
        from .mpi_ops import sparse_allreduce_async

        wait = sparse_allreduce_async(param.grad.coalesce(), name, self._gs_op, self._gs_process_set)

        def finish() -> None:
            param.grad = wait().coalesce()

        return finish

    def synchronize(self) -> None:
        """Wait until every gradient of this step is reduced, without stepping.

        Parameters that received no gradient on this rank in a step where others did (an unused
        branch) are reduced with zeros, so no rank waits for them. Does nothing if no backward ran
        since the last step, so stale gradients are never reduced twice.

        With ``op=Adasum`` it does nothing: the update is reduced by :meth:`step` (as Horovod's).

        Raises:
            CollectiveError, ShutdownError: a gradient's allreduce failed (message names it).
        """
        self._gs_synchronized = True
        if self._gs_adasum or (not self._gs_handles and not any(self._gs_counts.values())):
            return
        for param in self._gs_names:
            if param not in self._gs_handles:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                self._gs_submit(param)
        waits, self._gs_handles = self._gs_handles, {}
        self._gs_counts = dict.fromkeys(self._gs_counts, 0)
        self._gs_group_ready = {}
        self._gs_write_backward()
        for wait in waits.values():
            wait()
        for param in self._gs_densified:
            param.grad = param.grad.to_sparse()
        self._gs_densified = []

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Within this block ``step()`` does not synchronize; use it after an explicit
        ``synchronize()``, e.g. to clip the reduced gradients before stepping::

            loss.backward()
            optimizer.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            with optimizer.skip_synchronize():
                optimizer.step()

        Raises:
            AssertionError: with ``op=Adasum``, whose step() reduces the update itself (Horovod's).
        """
        if self._gs_adasum:
            raise AssertionError("gradsync: skip_synchronize() has no meaning with op=Adasum: step() "
                                 "reduces the wrapped optimizer's update itself; call step() alone")
        self._gs_skip = True
        try:
            yield
        finally:
            self._gs_skip = False

    def step(self, closure=None):
        """Wait for this step's gradient allreduces (unless inside skip_synchronize), then step.

        The first call also checks that the ranks hold the same parameters (one small allreduce);
        see :meth:`_gs_check_parameters_agree`. A ``synchronize()`` since the last step without
        ``skip_synchronize()`` around this one gets Horovod's warning (gradsync does not reduce
        twice). With ``op=Adasum``: see :meth:`_gs_adasum_step`.
        """
        if not self._gs_skip:
            if self._gs_synchronized and not self._gs_adasum:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context "
                              "after optimizer.synchronize(): gradsync does not reduce the gradients "
                              "again, but wrap step() in `with optimizer.skip_synchronize():` to say "
                              "that you meant it", stacklevel=2)
            self.synchronize()
        self._gs_synchronized = False
        if not self._gs_parameters_checked:
            self._gs_parameters_checked = True
            self._gs_check_parameters_agree()
        if self._gs_adasum:
            return self._gs_adasum_step(closure)
        return super().step(closure)

    def _gs_adasum_step(self, closure):
        """Horovod's Adasum optimizer: the wrapped optimizer steps on this rank's own (locally
        accumulated) gradients, the update of every parameter (its change, learning rate and
        momentum included) is combined across ranks by Adasum, and every rank applies the combined
        update to its parameters as they were before the step. One grouped Adasum allreduce per
        dtype (after ``compression``), on host memory (CUDA tensors are staged)."""
        from .mpi_ops import grouped_allreduce_async_

        params = list(self._gs_names)
        with torch.no_grad():
            start = [p.detach().clone() for p in params]
        loss = super().step(closure)
        by_dtype: dict[torch.dtype, list[tuple[torch.Tensor, torch.Tensor, object, torch.Tensor]]] = {}
        with torch.no_grad():
            for param, before in zip(params, start):
                param.sub_(before)  # the update, reduced in the parameter's own memory
                compressed, context = self._gs_compression.compress(param.detach())
                by_dtype.setdefault(compressed.dtype, []).append((param, compressed, context, before))
            handles = [grouped_allreduce_async_([m[1] for m in members], op=ReduceOp.Adasum,
                                                name=f"adasum.{self._gs_names[params[0]]}.{dtype}",
                                                process_set=self._gs_process_set)
                       for dtype, members in by_dtype.items()]
            for handle in handles:
                ops.synchronize(handle)
            for param, compressed, context, before in (m for g in by_dtype.values() for m in g):
                param.copy_(before + self._gs_compression.decompress(compressed, context))
        return loss

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
        """Zero the gradients, refusing while their allreduces are still in flight.

        Raises:
            RuntimeError: called between backward() and step(): the background allreduce writes
                into the gradients it would zero.
        """
        if self._gs_handles:
            names = sorted(self._gs_names[p] for p in self._gs_handles)
            raise RuntimeError(
                f"gradsync: rank {self._gs_rank}: optimizer.zero_grad() was called after backward() "
                f"but before step(): the gradients of {len(names)} parameter(s) (e.g. {names[0]!r}) "
                "are still being allreduced in the background, and zeroing them now races with that. "
                "Call optimizer.step() or optimizer.synchronize() first.")
        super().zero_grad(set_to_none=set_to_none)

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
        if self._gs_handles:
            raise RuntimeError(f"gradsync: rank {self._gs_rank}: set_backward_passes_per_step() while "
                               "gradients are being reduced; call step() or synchronize() first")
        self._gs_passes = int(passes)
        self._gs_counts = dict.fromkeys(self._gs_counts, 0)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load optimizer state (torch semantics) after finishing any allreduce in flight."""
        for wait in self._gs_handles.values():
            wait()
        self._gs_handles = {}
        self._gs_counts = dict.fromkeys(self._gs_counts, 0)
        self._gs_group_ready = {}
        super().load_state_dict(state_dict)


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


def _reduction_groups(params: list[torch.Tensor], groups: int | list, rank: int) -> dict:
    """param -> (group index, the group's parameters).

    ``groups`` is an int N: ``params`` in order, cut into N contiguous groups as evenly as possible
    (the first ones one parameter larger; 0: no groups); or a list of lists of parameters: each list
    a group, in its order, without the parameters that are not in ``params`` (no ``requires_grad``).
    Parameters in no group are reduced on their own, as Horovod's singleton groups.
    """
    if isinstance(groups, int):
        bounds = np.cumsum([0, *split_rows(len(params), groups)]) if groups else [0]
        chunks = [params[a:b] for a, b in zip(bounds, bounds[1:])]
    else:
        _check_groups(groups, rank)
        tracked = {id(p) for p in params}
        chunks = [[p for p in group if id(p) in tracked] for group in groups]
    return {param: (index, tuple(members))
            for index, members in enumerate(chunks) for param in members}


def _check_groups(groups: list, rank: int) -> None:
    """``groups=`` as a list: lists of the optimizer's parameters, each in one group at most."""
    seen: set[int] = set()
    for index, group in enumerate(groups):
        if not isinstance(group, (list, tuple)) or not all(isinstance(p, torch.Tensor) for p in group):
            raise ValueError(f"gradsync: rank {rank}: groups[{index}] must be a list of parameters "
                             f"(torch.Tensor), got {type(group).__qualname__}")
        for p in group:
            if id(p) in seen:
                raise ValueError(f"gradsync: rank {rank}: a parameter of shape {tuple(p.shape)} is in "
                                 "groups twice; a parameter may appear in one group only")
            seen.add(id(p))


def _nothing() -> None:
    """The wait of a parameter whose group is reduced (and waited for) through its last one."""


def _call_all(waits: list[Callable[[], None]]) -> None:
    for wait in waits:
        wait()


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
                         process_set: ProcessSet = global_process_set) -> torch.optim.Optimizer:
    """Make ``optimizer`` data-parallel: gradients are allreduced while backward runs.

    A post-accumulate-grad hook on every parameter with ``requires_grad`` starts an asynchronous
    in-place allreduce of its gradient as soon as backward has produced it, so communication
    overlaps the rest of backward. ``step()`` waits for this step's allreduces, then runs the
    wrapped optimizer's step. With ``op=Average`` and equal per-rank batches, N ranks compute the
    same update as one process on the N-times larger batch (same semantics, and the same argument
    order, as Horovod's ``hvd.DistributedOptimizer``).

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
            number of ranks), as Horovod's Adasum optimizer.
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
            allreduced like the others, and made sparse again before the wrapped optimizer steps
            (as Horovod). By default they are reduced by an allgather of their indices and values,
            and ``param.grad`` becomes the coalesced sparse sum (divided by the number of ranks for
            Average): cheaper when few rows are touched. A rank on which such a parameter got no
            gradient in a step contributes dense zeros, which only matches the others with
            ``sparse_as_dense=True``.
        process_set: the ranks among which gradients are averaged (default: every rank); Average
            divides by its size. On a rank outside it the optimizer reduces nothing and steps on
            that rank's own gradients (as Horovod's).

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
        TypeError: ``compression`` has no ``compress``/``decompress`` methods.
        NotInitializedError: before ``gradsync.init()``.
    """
    if named_parameters is not None:
        named_parameters = list(named_parameters)
        # Checked before anything else, as Horovod does (also before init: the rank may be unknown).
        _check_names(named_parameters, [], runtime.get().rank if runtime.is_initialized() else "?")
    rank = runtime.get().rank
    op, groups = _check_arguments(optimizer, rank, backward_passes_per_step, op,
                                  gradient_predivide_factor, num_groups, groups, compression,
                                  process_set)
    original = type(optimizer)
    optimizer.__class__ = _distributed_class(original)
    try:
        optimizer._gradsync_setup(named_parameters, int(backward_passes_per_step), op,
                                  float(gradient_predivide_factor), bool(sparse_as_dense),
                                  compression, process_set, groups)
    except BaseException:
        optimizer.__class__ = original  # a failed wrap leaves the optimizer as it was
        raise
    return optimizer


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
    if op == ReduceOp.Adasum and process_set.size() & (process_set.size() - 1):
        raise NotImplementedError(f"gradsync: rank {rank}: op=Adasum needs a power-of-two number of "
                                  f"ranks (as Horovod's), but {process_set} has {process_set.size()}")
    if not (callable(getattr(compression, "compress", None))
            and callable(getattr(compression, "decompress", None))):
        raise TypeError(f"gradsync: rank {rank}: compression={compression!r} needs compress() and "
                        "decompress() methods (see gradsync.Compression)")
    if op == ReduceOp.Adasum and process_set.size() == 1:
        op = ReduceOp.Average
    return op, num_groups if groups is None else groups


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
