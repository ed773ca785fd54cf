"""The first step's check that the ranks hold the same parameters (a warning, not an error).

The most common silent mistake in data-parallel training is a model built with a rank-dependent or
unseeded initialisation and no :func:`gradsync.broadcast_parameters`: every rank then applies the
same averaged update to different weights, and the ranks never agree. DistributedOptimizer and
ZeroRedundancyOptimizer run :func:`warn_if_parameters_differ` at their first ``step()``.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from .. import ops
from ..process_sets import ProcessSet
from ..protocol import ReduceOp

log = logging.getLogger("gradsync")

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32}


def warn_if_parameters_differ(names: dict[torch.Tensor, str], process_set: ProcessSet,
                              rank: int) -> None:
    """Warn, from the process set's first rank, when the ranks' parameters differ.

    Each parameter's bits are summed as integers (exact, and the same whatever the order of
    the sum, so equal parameters always compare equal) and compared by one allreduce (Max of
    ``[sums, -sums]``, 16 bytes per parameter) on ``process_set``, named after the first
    parameter. A warning, not an error: DDP copies rank 0's parameters at construction, Horovod
    leaves it to the user. Every rank of ``process_set`` must call it with the same parameters.

    Args:
        names: parameter -> its name, in the optimizer's order (host or CUDA tensors).
        process_set: the ranks that compare their parameters.
        rank: this process's world rank, for the message.
    """
    params = list(names)
    if process_set.size() == 1 or not params:
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
                        name=f"gradsync.parameter_check.{names[params[0]]}", process_set=process_set)
    differ = [names[params[i]] for i in range(n) if top[i] != -top[n + i]]  # max != min
    if differ and process_set.rank() == 0:
        _warn(differ, n, process_set, rank)


def _warn(differ: list[str], n: int, process_set: ProcessSet, rank: int) -> None:
    where = "root_rank=0"
    if process_set.process_set_id != 0:
        where = (f"root_rank={process_set.ranks[0]}, process_set=<this optimizer's "
                 f"{process_set}>")
    log.warning(
        "gradsync: rank %d: the ranks hold different parameters at the first step(): %d of "
        "%d differ, e.g. %s. Every rank would apply the same averaged update to different "
        "weights, and they would never agree. Call gradsync.broadcast_parameters("
        "model.state_dict(), %s) once before training (and "
        "gradsync.broadcast_optimizer_state(optimizer, %s) when resuming).",
        rank, len(differ), n, ", ".join(map(repr, differ[:3])), where, where)


def _bit_sum(param: torch.Tensor) -> torch.Tensor:
    """The sum of ``param``'s bits read as integers (int64, on its device): equal tensors give equal
    sums, exactly, in any order of summation; 8- and 16-byte elements are read as int32 words."""
    flat = param.detach().contiguous().reshape(-1)
    return flat.view(_INT_OF_SIZE.get(flat.element_size(), torch.int32)).sum(dtype=torch.int64)
