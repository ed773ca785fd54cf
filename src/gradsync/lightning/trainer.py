"""``GradsyncStrategy``: the Lightning Trainer's strategy on gradsync (``Trainer(strategy="gradsync")``).

What Lightning's DDP strategy does with ``torch.distributed``, this does with gradsync.torch:
parameters broadcast from rank 0 at setup, every optimizer wrapped by ``DistributedOptimizer``
(gradients averaged while backward runs), Lightning's collectives on gradsync's. The processes and
their ranks come from the MPI launcher (``mpiexec``/``srun``); Lightning launches nothing.
docs/lightning.md has the user's guide.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from . import collectives
from .environment import GradsyncEnvironment, check_launch, root_device
from .optimizers import wrap


class GradsyncStrategy(collectives.CollectivesMixin, ParallelStrategy):
    """Data-parallel training for ``lightning.pytorch.Trainer`` on gradsync, launched by MPI.

    ::

        # mpiexec -n 4 python train.py
        import gradsync.lightning  # registers strategy="gradsync"
        trainer = lightning.Trainer(strategy="gradsync", max_epochs=10)
        trainer.fit(model, datamodule)

    * Ranks, world size, local rank and node rank are gradsync's (:class:`GradsyncEnvironment`);
      ``devices`` and ``num_nodes`` must agree with the launch (``check_launch``).
    * At setup every rank takes rank 0's parameters and buffers (``broadcast_parameters``); when
      fitting, every optimizer from ``configure_optimizers`` is wrapped in place by
      ``gradsync.DistributedOptimizer`` (``zero=True``: ``ZeroRedundancyOptimizer``) with
      ``backward_passes_per_step = accumulate_grad_batches``, so accumulating batches communicate
      nothing; LR schedulers keep working.
    * Gradients are averaged before Lightning clips them (by norm or value) and before the
      optimizer steps; ``precision="16-mixed"`` unscales averaged gradients, so every rank takes the
      same skip-or-step decision.
    * ``self.log(..., sync_dist=True)``, ``all_gather``, ``broadcast``, ``barrier`` and torchmetrics
      go through gradsync's collectives (:mod:`gradsync.lightning.collectives`).

    Args:
        zero: shard the optimizer state over the ranks (``gradsync.ZeroRedundancyOptimizer``).
        **optimizer_options: keyword arguments of ``gradsync.DistributedOptimizer`` (or of
            ``ZeroRedundancyOptimizer`` with ``zero``): ``compression``, ``comm_hook``, ``op``,
            ``groups``, ``gradient_predivide_factor``, ``process_set``, ... Not
            ``named_parameters`` (the module's names are used) nor ``backward_passes_per_step``
            (``Trainer(accumulate_grad_batches=...)`` sets it).

    Raises:
        ValueError: ``named_parameters`` or ``backward_passes_per_step`` among the options; later,
            a ``devices``/``num_nodes`` that disagrees with the launch (named).
    """

    strategy_name = "gradsync"

    def __init__(self, accelerator=None, parallel_devices: list[torch.device] | None = None,
                 checkpoint_io=None, precision_plugin=None, zero: bool = False,
                 **optimizer_options: Any) -> None:
        refused = {"named_parameters", "backward_passes_per_step"} & set(optimizer_options)
        if refused:
            raise ValueError(f"gradsync: GradsyncStrategy sets {sorted(refused)} itself (the module's "
                             "parameter names; Trainer(accumulate_grad_batches=...))")
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=GradsyncEnvironment(), checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self.num_nodes = 1
        self._zero = bool(zero)
        self._options = optimizer_options
        self._passes = 1

    @property
    def root_device(self) -> torch.device:
        """The CPU, or this rank's GPU (``environment.root_device``)."""
        return root_device(self.parallel_devices)

    @property
    def is_distributed(self) -> bool:
        """True: Lightning then gives each rank its share of the data (a DistributedSampler)."""
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def set_world_ranks(self) -> None:
        """Called by the Trainer once ``devices``/``num_nodes`` are known: check them against the
        launch, and make Lightning's rank-zero-only utilities use gradsync's rank."""
        check_launch(len(self.parallel_devices or [None]), self.num_nodes)
        rank_zero_only.rank = self.global_rank

    def model_to_device(self) -> None:
        self.model.to(self.root_device)

    def setup(self, trainer) -> None:
        """Lightning's setup (precision, device, optimizers), then rank 0's parameters on every rank
        and, when fitting, the optimizers wrapped by gradsync (see the class docstring)."""
        super().setup(trainer)
        import gradsync.torch as gs_torch

        gs_torch.broadcast_parameters(self.model.state_dict(), root_rank=0)
        collectives.connect_metrics(self.model)
        if trainer.state.fn == TrainerFn.FITTING:
            self._passes = trainer.accumulate_grad_batches
            options = dict(self._options, backward_passes_per_step=self._passes)
            self.optimizers = [wrap(o, self.lightning_module, self._zero, options) for o in self.optimizers]
            if self._zero:
                self.precision_plugin.clip_grad_by_norm = _clip_sharded_by_norm

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Follow a change of ``accumulate_grad_batches`` (GradientAccumulationScheduler: at an
        epoch's start, after a step, so nothing is in flight)."""
        passes = self.lightning_module.trainer.accumulate_grad_batches
        if passes != self._passes and self.lightning_module.automatic_optimization:
            self._passes = passes
            for optimizer in self.optimizers:
                optimizer.set_backward_passes_per_step(passes)

    def optimizer_step(self, optimizer, closure: Callable[[], Any], model=None, **kwargs: Any) -> Any:
        """Lightning's step through the precision plugin, with the gradients averaged right after
        the closure (training step and backward), before clipping, unscaling and ``step()``.

        The closure is evaluated once, then the optimizer steps without it; an optimizer that
        evaluates its closure itself (``torch.optim.LBFGS``) gets it, and averages the gradients
        and the loss of every evaluation (DistributedOptimizer's ``step(closure)``)."""
        if isinstance(optimizer, torch.optim.LBFGS):
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def averaged() -> Any:
            result = closure()
            optimizer.synchronize()
            return result

        with _closure_then_step(optimizer), optimizer.skip_synchronize():
            return super().optimizer_step(optimizer, averaged, model, **kwargs)


@contextlib.contextmanager
def _closure_then_step(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Within the block, ``optimizer.step(closure)`` (what Lightning's precision plugins call)
    evaluates the closure, then steps without it: one period per step, as in plain PyTorch, so the
    gradients accumulated before the closure (accumulate_grad_batches) stay in the step's round."""
    saved = vars(optimizer).get("step")
    step = saved or functools.partial(type(optimizer).step, optimizer)

    def closure_then_step(closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        result = closure() if closure is not None else None
        step(**kwargs)
        return result

    optimizer.step = closure_then_step
    try:
        yield
    finally:
        if saved is not None:
            optimizer.step = saved
        else:
            del optimizer.step


def _clip_sharded_by_norm(optimizer: torch.optim.Optimizer, clip_val: float) -> None:
    """Lightning's clip by norm for ZeroRedundancyOptimizer: the norm over every rank's shard."""
    optimizer.clip_grad_norm_(clip_val)
