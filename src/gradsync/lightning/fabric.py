"""``GradsyncFabricStrategy``: Lightning Fabric's strategy on gradsync (``Fabric(strategy="gradsync")``).

``fabric.setup(model, optimizer)`` broadcasts rank 0's parameters and wraps the optimizer with
``gradsync.DistributedOptimizer``; ``fabric.backward(loss)`` averages the gradients while it runs;
``fabric.no_backward_sync(model, enabled=...)`` defers the averaging of accumulating passes to the
step; ``fabric.clip_gradients`` clips averaged gradients. docs/lightning.md has the guide.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from lightning.fabric.strategies import ParallelStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.rank_zero import rank_zero_only

from . import collectives
from .environment import GradsyncEnvironment, check_launch, root_device
from .optimizers import synchronized, wrap

# backward_passes_per_step inside no_backward_sync: no pass completes a step's gradients there;
# the step's synchronize() averages what the passes accumulated.
_DEFERRED = 2**31 - 1


class GradsyncFabricStrategy(collectives.CollectivesMixin, ParallelStrategy):
    """Data-parallel training for ``lightning.fabric.Fabric`` on gradsync, launched by MPI.

    Same behaviour and arguments as :class:`gradsync.lightning.GradsyncStrategy` (ranks from the
    launch, parameters from rank 0, optimizers wrapped in place, Lightning's collectives on
    gradsync's), for Fabric's loop::

        fabric = Fabric(strategy="gradsync")   # after `import gradsync.lightning`
        model, optimizer = fabric.setup(model, optimizer)
        for i, batch in enumerate(loader):
            with fabric.no_backward_sync(model, enabled=(i + 1) % k != 0):
                fabric.backward(model(batch).mean())   # averaged here unless accumulating
            if (i + 1) % k == 0:
                fabric.clip_gradients(model, optimizer, max_norm=1.0)
                optimizer.step()
                optimizer.zero_grad()

    ``backward_passes_per_step`` may be given here (it is DistributedOptimizer's): the passes
    accumulated before the averaging starts in backward; ``no_backward_sync`` defers it to
    ``optimizer.step()`` (or ``fabric.clip_gradients``) for the passes inside it.

    Raises:
        ValueError: ``named_parameters`` among the options; later, a ``devices``/``num_nodes`` that
            disagrees with the launch (named).
    """

    def __init__(self, accelerator=None, parallel_devices: list[torch.device] | None = None,
                 checkpoint_io=None, precision=None, zero: bool = False, **optimizer_options: Any) -> None:
        if "named_parameters" in optimizer_options:
            raise ValueError("gradsync: GradsyncFabricStrategy names the parameters by the module's "
                             "names; leave named_parameters out")
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=GradsyncEnvironment(), checkpoint_io=checkpoint_io,
                         precision=precision)
        self._num_nodes = 1
        self._zero = bool(zero)
        self._options = optimizer_options
        self._passes = int(optimizer_options.get("backward_passes_per_step", 1))
        self._module: torch.nn.Module | None = None
        self._wrapped: list[torch.optim.Optimizer] = []
        self._backward_sync_control = _DeferredSync(self)

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @property
    def root_device(self) -> torch.device:
        return root_device(self.parallel_devices)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def _set_world_ranks(self) -> None:
        check_launch(len(self.parallel_devices or [None]), self._num_nodes)
        rank_zero_only.rank = self.global_rank

    def module_to_device(self, module: torch.nn.Module) -> None:
        module.to(self.root_device)

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Rank 0's parameters and buffers on every rank; torchmetrics inside sync via gradsync."""
        import gradsync.torch as gs_torch

        gs_torch.broadcast_parameters(module.state_dict(), root_rank=0)
        collectives.connect_metrics(module)
        self._module = module
        return module

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """``optimizer`` wrapped in place by gradsync (named by the module set up last)."""
        wrapped = wrap(optimizer, self._module or torch.nn.Module(), self._zero, self._options)
        self._wrapped.append(wrapped)
        return wrapped

    def optimizer_step(self, optimizer, **kwargs: Any) -> Any:
        """Average what is left of this step's gradients, then step through the precision plugin;
        the passes deferred by ``no_backward_sync`` count afresh from here."""
        with synchronized(optimizer):
            result = self.precision.optimizer_step(optimizer, **kwargs)
        self._backward_sync_control.resume(optimizer)
        return result

    def clip_gradients_norm(self, module, optimizer, max_norm, norm_type=2.0,
                            error_if_nonfinite: bool = True) -> torch.Tensor:
        """Clip the averaged gradients by their global norm (the sharded norm with ``zero``)."""
        inner = getattr(optimizer, "optimizer", optimizer)
        inner.synchronize()
        if not self._zero:
            return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)
        self.precision.unscale_gradients(optimizer)
        return inner.clip_grad_norm_(max_norm, norm_type)

    def clip_gradients_value(self, module, optimizer, clip_val) -> None:
        """Clip the averaged gradients, element by element."""
        getattr(optimizer, "optimizer", optimizer).synchronize()
        super().clip_gradients_value(module, optimizer, clip_val)


class _DeferredSync(_BackwardSyncControl):
    """``fabric.no_backward_sync``: inside it, backward passes only accumulate (no collective);
    the next ``optimizer.step()`` (or clip) averages the accumulated gradients in one round."""

    def __init__(self, strategy: GradsyncFabricStrategy) -> None:
        self._strategy = strategy
        self._deferred: set[int] = set()

    @contextlib.contextmanager
    def no_backward_sync(self, module: torch.nn.Module, enabled: bool) -> Iterator[None]:
        if enabled:
            for optimizer in self._strategy._wrapped:
                if id(optimizer) not in self._deferred:
                    optimizer.set_backward_passes_per_step(_DEFERRED)
                    self._deferred.add(id(optimizer))
        yield

    def resume(self, optimizer: torch.optim.Optimizer) -> None:
        """After a step: backward averages again after the configured number of passes."""
        if id(optimizer) in self._deferred:
            self._deferred.discard(id(optimizer))
            optimizer.set_backward_passes_per_step(self._strategy._passes)
