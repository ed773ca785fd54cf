"""The PyTorch adapter: DistributedOptimizer, communication hooks, broadcast_parameters,
broadcast_optimizer_state.

Importing it imports torch; ``import gradsync`` alone does not.
"""

from .buckets import Bucket
from .comm_hooks import allreduce_hook, bf16_compress_hook, fp16_compress_hook
from .functions import broadcast_optimizer_state, broadcast_parameters
from .optimizer import DistributedOptimizer
from .powersgd import PowerSGD

__all__ = ["DistributedOptimizer", "broadcast_parameters", "broadcast_optimizer_state",
           "Bucket", "allreduce_hook", "fp16_compress_hook", "bf16_compress_hook", "PowerSGD"]
