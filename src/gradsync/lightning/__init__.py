"""Lightning on gradsync: ``GradsyncStrategy`` for the Trainer, ``GradsyncFabricStrategy`` for Fabric.

Importing this module imports Lightning (``pip install gradsync[lightning]``) and registers the
strategy names with Lightning's registries, so that afterwards::

    lightning.Trainer(strategy="gradsync")       # or "gradsync_zero": sharded optimizer state
    lightning.Fabric(strategy="gradsync")

work under ``mpiexec``/``srun``. Lightning 2.x looks strategy names up in registries filled at
import time and has no entry point for strategies from other packages, so ``import
gradsync.lightning`` (or passing ``strategy=GradsyncStrategy()``) is needed once per process;
``import gradsync`` alone does not import Lightning. See docs/lightning.md.
"""

from __future__ import annotations

from lightning.fabric.strategies import STRATEGY_REGISTRY as _FABRIC_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry as _TRAINER_REGISTRY

from .collectives import gather_all_tensors
from .environment import GradsyncEnvironment
from .fabric import GradsyncFabricStrategy
from .trainer import GradsyncStrategy

GradsyncStrategy.register_strategies(_TRAINER_REGISTRY)
GradsyncFabricStrategy.register_strategies(_FABRIC_REGISTRY)

__all__ = ["GradsyncStrategy", "GradsyncFabricStrategy", "GradsyncEnvironment", "gather_all_tensors"]
