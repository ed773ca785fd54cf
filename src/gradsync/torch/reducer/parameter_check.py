"""Do the ranks hold the same parameters? Two checks of a distributed optimizer, run once.

* **The same model** (an error): ranks whose models differ (a rank-dependent architecture, a
  parameter created on one rank only, another width) would otherwise meet in the round's internal
  collectives with shapes the user never made. Before its first collective a distributed
  optimizer compares, across its process set, a digest of its parameters' names, shapes and
  dtypes (:func:`check_same_model`, one small allreduce); where they differ, every rank gathers
  every rank's list and raises an error that says how many parameters each rank has, which
  parameters some ranks have and others do not, and the first whose shape or dtype differs: the
  check PyTorch DDP runs at construction (``_verify_param_shape_across_processes``).
* **The same values** (a warning): the most common silent mistake in data-parallel training is a
  model built with a rank-dependent or unseeded initialisation and no
  :func:`gradsync.broadcast_parameters`: every rank then applies the same averaged update to
  different weights, and the ranks never agree. DistributedOptimizer and ZeroRedundancyOptimizer
  run :func:`warn_if_parameters_differ` at their first ``step()``.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable

import numpy as np
import torch

from ... import ops
from ...engine.protocol import ReduceOp
from ...errors import CollectiveError
from ...process_sets import ProcessSet

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

Spec = tuple[str, tuple[int, ...], str]  # (name, shape, dtype) of one parameter


def parameter_specs(named: Iterable[tuple[str, torch.Tensor]]) -> list[Spec]:
    """(name, shape, dtype name) of each parameter, in the given order."""
    return [(name, tuple(p.shape), str(p.dtype).removeprefix("torch.")) for name, p in named]


def check_same_model(specs: list[Spec], process_set: ProcessSet, rank: int, tag: str) -> None:
    """Raise on every rank of ``process_set`` if its ranks' ``specs`` differ; return otherwise.

    Collective: every rank of ``process_set`` must call it (with ``tag``, the same on every rank,
    naming the collectives). One allreduce (Max) of a 63-bit digest and its negation, 16 bytes;
    where they differ, also an allgather of every rank's specs. A rank that has joined contributes
    the identity, so it never counts as different.

    Raises:
        CollectiveError: the ranks' parameters differ in number, names, shapes or dtypes; the
            message says how many parameters each rank has, the names present on some ranks only
            (with their ranks and shapes), and the first parameter whose shape or dtype differs.
    """
    digest = int.from_bytes(hashlib.sha256(repr(specs).encode()).digest()[:8], "little") >> 1
    top = ops.allreduce(np.array([digest, -digest], np.int64), op=ReduceOp.Max,
                        name=f"gradsync.{tag}", process_set=process_set)
    if top[0] == -top[1]:  # max == min: every rank has the same digest
        return
    gathered = ops.allgather_object((rank, specs), name=f"gradsync.{tag}.specs",
                                    process_set=process_set)  # a joined rank adds no entry
    raise CollectiveError(f"gradsync: rank {rank}: {describe_differences(dict(gathered))}")


def describe_differences(by_rank: dict[int, list[Spec]]) -> str:
    """The message for ranks whose parameter lists differ: counts, names on some ranks only, and
    the first parameter whose shape or dtype differs. ``by_rank``: world rank -> its specs."""
    counts = ", ".join(f"rank {r}: {len(specs)}" for r, specs in by_rank.items())
    lines = [f"the ranks' models differ: parameters per rank: {counts}."]
    where: dict[str, dict[int, Spec]] = {}
    for r, specs in by_rank.items():
        for spec in specs:
            where.setdefault(spec[0], {})[r] = spec
    partial = [(name, on) for name, on in where.items() if len(on) < len(by_rank)]
    if partial:
        shown = "; ".join(f"{name!r} {_shape(next(iter(on.values())))} only on rank(s) "
                          f"{sorted(on)}" for name, on in partial[:5])
        more = f" (and {len(partial) - 5} more)" if len(partial) > 5 else ""
        lines.append(f"Present on some ranks only: {shown}{more}.")
    for name, on in where.items():
        if len(on) == len(by_rank) and len({spec[1:] for spec in on.values()}) > 1:
            each = ", ".join(f"rank {r}: {_shape(spec)} {spec[2]}" for r, spec in on.items())
            lines.append(f"First parameter that differs: {name!r}: {each}.")
            break
    if not partial and len(lines) == 1:
        lines.append("The same names in another order: " + ", ".join(
            f"rank {r}: {[s[0] for s in specs[:3]]}" for r, specs in by_rank.items()) + ".")
    lines.append("Every rank must build the same model (same parameters, shapes and dtypes, in the "
                 "same order) before wrapping its optimizer.")
    return " ".join(lines)


def _shape(spec: Spec) -> str:
    return str(spec[1])
