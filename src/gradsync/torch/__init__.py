"""The PyTorch adapter: DistributedOptimizer, broadcast_parameters, broadcast_optimizer_state.

Importing it imports torch; ``import gradsync`` alone does not.
"""

from .functions import broadcast_optimizer_state, broadcast_parameters
from .optimizer import DistributedOptimizer

__all__ = ["DistributedOptimizer", "broadcast_parameters", "broadcast_optimizer_state"]
