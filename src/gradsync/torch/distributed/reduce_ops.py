"""torch's ``ReduceOp`` on gradsync's engine: which engine op and scale computes each one.

SUM, AVG, PRODUCT, MIN and MAX are the engine's own ops; PREMUL_SUM is its Sum with the factor as
the prescale factor. The engine has no bitwise ops: BAND, BOR and BXOR (integer and bool tensors)
gather every rank's tensor and fold it here, the same fold on every rank.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...engine.protocol import ReduceOp

RedOpType = dist.ReduceOp.RedOpType

_ENGINE_OPS = {
    RedOpType.SUM: ReduceOp.Sum,
    RedOpType.AVG: ReduceOp.Average,
    RedOpType.PRODUCT: ReduceOp.Product,
    RedOpType.MIN: ReduceOp.Min,
    RedOpType.MAX: ReduceOp.Max,
    RedOpType.PREMUL_SUM: ReduceOp.Sum,
}

_BITWISE: dict[RedOpType, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    RedOpType.BAND: torch.bitwise_and,
    RedOpType.BOR: torch.bitwise_or,
    RedOpType.BXOR: torch.bitwise_xor,
}


@dataclass(frozen=True)
class Reduction:
    """How to compute one torch reduction: the engine's ``op`` with ``prescale``, or (``fold`` not
    None) a gather of every rank's tensor folded with ``fold``."""

    op: ReduceOp
    prescale: float = 1.0
    fold: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def gathered(self, rows: torch.Tensor) -> torch.Tensor:
        """The fold of ``rows`` (every rank's tensor, stacked along dimension 0) over the ranks."""
        return functools.reduce(self.fold, rows.unbind(0))


def reduction(op: dist.ReduceOp | None, dtype: torch.dtype, where: str) -> Reduction:
    """The :class:`Reduction` of torch's ``op`` (None: SUM) on tensors of ``dtype``.

    Raises:
        TypeError: a bitwise op on a floating-point tensor; an op torch has that gradsync does not
            (the message names it and ``where``).
    """
    # The op's kind as a Python int: every call on torch's RedOpType (``.op``, ``==``, hashing it
    # as a key) goes through pybind11, some microseconds each when its code is not in the
    # CPU's caches (a blocking call between others); an int is compared and hashed in C.
    value = _SUM if op is None else int(_kind(op))
    if value == _PREMUL_SUM:
        return _reduction(_kind(op), op, dtype, where)
    return _plain(value, dtype, where)  # the same answer every time for (op, dtype): made once


_SUM, _PREMUL_SUM = int(RedOpType.SUM), int(RedOpType.PREMUL_SUM)
_KINDS = {int(kind): kind for kind in RedOpType.__members__.values()}


@functools.lru_cache(maxsize=256)
def _plain(value: int, dtype: torch.dtype, where: str) -> Reduction:
    return _reduction(_KINDS[value], None, dtype, where)


def _reduction(kind: RedOpType, op: dist.ReduceOp | None, dtype: torch.dtype, where: str) -> Reduction:
    if kind in _BITWISE:
        if dtype.is_floating_point or dtype.is_complex:
            raise TypeError(f"{where}: ReduceOp.{kind.name} needs an integer or bool tensor, got {dtype}")
        return Reduction(ReduceOp.Sum, fold=_BITWISE[kind])
    if kind not in _ENGINE_OPS:
        raise TypeError(f"{where}: ReduceOp.{kind.name} is not supported by the gradsync backend")
    prescale = _factor(op) if kind == RedOpType.PREMUL_SUM else 1.0
    return Reduction(_ENGINE_OPS[kind], prescale)


def _kind(op: dist.ReduceOp | RedOpType) -> RedOpType:
    """The RedOpType of a ReduceOp object (``opts.reduceOp``) or of a bare RedOpType."""
    return op if isinstance(op, RedOpType) else op.op


def _factor(op: dist.ReduceOp) -> float:
    """PREMUL_SUM's factor: a number or a one-element tensor (``_make_nccl_premul_sum``), read from
    ``op.factor`` (torch >= 2.13) or from the op's pickled state ``(op, factor)`` (older torch,
    which keeps the factor in C++ only)."""
    factor = op.factor if hasattr(op, "factor") else op.__getstate__()[1]
    return float(factor.item() if isinstance(factor, torch.Tensor) else factor)
