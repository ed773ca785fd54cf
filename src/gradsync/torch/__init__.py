"""The PyTorch adapter: DistributedOptimizer, ZeroRedundancyOptimizer, broadcast_parameters,
broadcast_optimizer_state.

Importing it imports torch; ``import gradsync`` alone does not.
"""

from .functions import broadcast_optimizer_state, broadcast_parameters
from .optimizer import DistributedOptimizer
from .zero import ZeroRedundancyOptimizer

__all__ = ["DistributedOptimizer", "ZeroRedundancyOptimizer", "broadcast_parameters",
           "broadcast_optimizer_state"]
