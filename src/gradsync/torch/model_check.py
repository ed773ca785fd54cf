"""Do the ranks train the same model? The check of a distributed optimizer's first round.

Ranks whose models differ (a rank-dependent architecture, a parameter created on one rank only,
another width) would otherwise meet in the round's internal collectives with shapes the user never
made. Before its first round a distributed optimizer compares, across its process set, a digest
of its parameters' names, shapes and dtypes (one small allreduce); where they differ, every rank
gathers every rank's list and raises an error that says how many parameters each rank has, which
parameters some ranks have and others do not, and the first whose shape or dtype differs: the
check PyTorch DDP runs at construction (``_verify_param_shape_across_processes``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np
import torch

from .. import ops
from ..errors import CollectiveError
from ..process_sets import ProcessSet
from ..protocol import ReduceOp

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
