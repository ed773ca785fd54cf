"""PowerSGD: low-rank gradient compression with error feedback, as a communication hook.

Vogels, Karimireddy and Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
Optimization", NeurIPS 2019; the same scheme as PyTorch's ``powerSGD_hook``. For each matrix
gradient M (a gradient reshaped to ``(shape[0], -1)``), with this rank's error from the last
step added (error feedback), and Q the last step's Q (warm start):

    P = M Q;  P = allreduce(P);  P = orthogonalize(P);  Q = M^T P;  Q = allreduce(Q);
    M ~ P Q^T (the average over the ranks);  error = M - P Q^T

so a rank sends (n + m) r numbers for an n x m matrix instead of n m. Vectors, and matrices whose
compression rate n m / ((n + m) r) is below ``min_compression_rate``, are allreduced as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .. import ops
from ..engine.protocol import ReduceOp
from .comm_hooks import Future, allreduce_hook
from .reducer.buckets import Bucket


@dataclass(frozen=True)
class Matrix:
    """A gradient of a bucket that PowerSGD compresses: its position in the bucket, its matrix
    shape (n, m) and the rank r of its approximation."""

    slot: int
    n: int
    m: int
    r: int


@dataclass(frozen=True)
class Traffic:
    """The elements one rank sent for one step's buckets, in bytes (``sent``), next to what plain
    allreduces of the same gradients send (``dense``)."""

    step: int
    sent: int
    dense: int


class PowerSGD:
    """The PowerSGD communication hook (``DistributedOptimizer(..., comm_hook=gradsync.PowerSGD())``).

    Args:
        rank: r, the rank of each matrix's approximation (torch's ``matrix_approximation_rank``);
            r = min(rank, n, m) per matrix.
        start_iter: the first ``start_iter`` steps this hook reduces are plain allreduces, as
            the paper's authors recommend (torch's ``start_powerSGD_iter``).
        min_compression_rate: a matrix whose n m / ((n + m) r) is below this is allreduced as it is.
        error_feedback: add to each matrix the error its approximation made at the last step.
        warm_start: start each step's power iteration from the last step's Q (else a new random Q).
        seed: seeds the first Q of every matrix: ``numpy.random.default_rng((seed, bucket.index,
            slot))`` (and ``(..., iteration)`` without warm start) draws it, standard normal, the
            same on every rank.
        epsilon: added to each column's norm in the Gram-Schmidt orthogonalisation (a zero column
            stays zero instead of becoming NaN).

    Every decision (which gradients are compressed, their shapes, the step) comes from the bucket's
    shapes and steps, the same on every rank. The hook keeps, per rank: ``iteration`` (the steps
    it has begun: one per new ``bucket.step``), the error and the Q of every matrix, and
    ``traffic``, the bytes of the last step. :meth:`state_dict`/:meth:`load_state_dict` save and
    restore the first three; they are not part of the optimizer's ``state_dict()``, and the
    errors differ between ranks, so each rank saves its own. Use one PowerSGD per optimizer.

    Raises:
        ValueError: ``rank < 1``, ``start_iter < 0`` or ``min_compression_rate`` not positive.
    """

    def __init__(self, rank: int = 1, start_iter: int = 10, min_compression_rate: float = 2.0,
                 error_feedback: bool = True, warm_start: bool = True, seed: int = 0,
                 epsilon: float = 1e-8) -> None:
        if int(rank) < 1 or int(start_iter) < 0 or not min_compression_rate > 0:
            raise ValueError(f"gradsync: PowerSGD needs rank >= 1, start_iter >= 0 and "
                             f"min_compression_rate > 0; got rank={rank}, start_iter={start_iter}, "
                             f"min_compression_rate={min_compression_rate}")
        self.rank = int(rank)
        self.start_iter = int(start_iter)
        self.min_compression_rate = float(min_compression_rate)
        self.error_feedback = bool(error_feedback)
        self.warm_start = bool(warm_start)
        self.seed = int(seed)
        self.epsilon = float(epsilon)
        self.errors: dict[tuple[str, int], torch.Tensor] = {}  # (bucket name, slot) -> error
        self.qs: dict[tuple[str, int], torch.Tensor] = {}  # (bucket name, slot) -> last Q
        self.traffic = Traffic(-1, 0, 0)
        self.iteration = 0
        self._last_step: int | None = None

    def __repr__(self) -> str:
        return (f"PowerSGD(rank={self.rank}, start_iter={self.start_iter}, "
                f"min_compression_rate={self.min_compression_rate})")

    def matrices(self, bucket: Bucket) -> list[Matrix]:
        """The gradients of ``bucket`` this hook compresses (from their shapes only)."""
        chosen = []
        for slot, shape in enumerate(bucket.shapes):
            if len(shape) < 2:
                continue
            n = shape[0]
            m = shape.numel() // n if n else 0
            r = min(self.rank, n, m)
            if r and n * m >= self.min_compression_rate * (n + m) * r:
                chosen.append(Matrix(slot, n, m, r))
        return chosen

    def __call__(self, bucket: Bucket) -> Future:
        """Start the first half (P and the uncompressed gradients) of ``bucket``'s reduction."""
        if bucket.step != self._last_step:
            self._last_step = bucket.step
            self.iteration += 1
        item = bucket.buffer.element_size()
        matrices = self.matrices(bucket) if self.iteration > self.start_iter else []
        if not matrices:
            self._count(bucket, bucket.buffer.numel() * item)
            return allreduce_hook(bucket)
        gradients = bucket.gradients()
        ms = [gradients[x.slot].view(x.n, x.m) for x in matrices]
        if self.error_feedback:
            for x, m in zip(matrices, ms):
                error = self.errors.get((bucket.name, x.slot))
                if error is not None:
                    m.add_(error.to(m.device))
        qs = [self._q(bucket, x) for x in matrices]
        ps = [m @ q for m, q in zip(ms, qs)]
        compressed = {x.slot for x in matrices}
        rest = [g for slot, g in enumerate(gradients) if slot not in compressed and g.numel()]
        first = ops.grouped_allreduce_async_(rest + ps, name=f"{bucket.name}.powersgd.p",
                                             op=ReduceOp.Average, process_set=bucket.process_set)
        self._count(bucket, item * (sum(g.numel() for g in rest) + sum(p.numel() for p in ps)
                                    + sum(x.m * x.r for x in matrices)))
        return _SecondHalf(self, bucket, matrices, ms, ps, first)

    def _q(self, bucket: Bucket, x: Matrix) -> torch.Tensor:
        key = (bucket.name, x.slot)
        if self.warm_start and key in self.qs:
            return self.qs[key].to(device=bucket.buffer.device).to(device=bucket.buffer.device)
        seed = (self.seed, bucket.index, x.slot) + (() if self.warm_start else (self.iteration - 1,))
        q = np.random.default_rng(seed).standard_normal((x.m, x.r))
        return torch.from_numpy(q).to(dtype=bucket.buffer.dtype, device=bucket.buffer.device)

    def _count(self, bucket: Bucket, sent: int) -> None:
        dense = bucket.buffer.numel() * bucket.buffer.element_size()
        if self.traffic.step != bucket.step:
            self.traffic = Traffic(bucket.step, 0, 0)
        self.traffic = Traffic(bucket.step, self.traffic.sent + sent, self.traffic.dense + dense)

    def finish(self, bucket: Bucket, matrices: list[Matrix], ms: list[torch.Tensor],
               ps: list[torch.Tensor], divisor: int) -> torch.Tensor:
        """The second half, once the Ps are averaged: orthogonalise them, allreduce the Qs, write
        each approximation into the buffer and keep the errors and Qs. For ``op=Sum`` the averaged
        buffer is multiplied back by ``divisor``, the divisor the core averaged the first half
        with (:attr:`gradsync.Handle.divisor`: the set's size, or the ranks that had not joined
        with ``GRADSYNC_JOIN_DIVISOR=contributors``)."""
        for p in ps:
            orthogonalize_(p, self.epsilon)
        qs = [m.t() @ p for m, p in zip(ms, ps)]
        ops.grouped_allreduce_(qs, name=f"{bucket.name}.powersgd.q", op=ReduceOp.Average,
                               process_set=bucket.process_set)
        for x, m, p, q in zip(matrices, ms, ps, qs):
            approximation = p @ q.t()
            if self.error_feedback:
                self.errors[(bucket.name, x.slot)] = m - approximation
            m.copy_(approximation)
            self.qs[(bucket.name, x.slot)] = q
        if bucket.op == ReduceOp.Sum:
            bucket.buffer.mul_(divisor)
        return bucket.buffer

    def state_dict(self) -> dict:
        """This rank's iteration count, errors and Qs (host copies), for a checkpoint per rank:
        ``{"iteration": int, "errors": {(bucket name, slot): tensor}, "qs": {...}}``."""
        return {"iteration": self.iteration,
                "errors": {k: v.cpu() for k, v in self.errors.items()},
                "qs": {k: v.cpu() for k, v in self.qs.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned (tensors move to the buckets' device at use).
        Every rank must load its own state of the same step (the iteration decides, with
        ``start_iter``, whether a step is compressed)."""
        self.iteration = int(state["iteration"])
        self._last_step = None
        self.errors = dict(state["errors"])
        self.qs = dict(state["qs"])


class _SecondHalf:
    """PowerSGD's future: ``wait()`` waits for the Ps, then runs :meth:`PowerSGD.finish`."""

    def __init__(self, hook: PowerSGD, bucket: Bucket, matrices: list[Matrix],
                 ms: list[torch.Tensor], ps: list[torch.Tensor], first) -> None:
        self.hook, self.bucket, self.matrices, self.ms, self.ps, self.first = (
            hook, bucket, matrices, ms, ps, first)

    def wait(self) -> torch.Tensor:
        self.first.wait()
        return self.hook.finish(self.bucket, self.matrices, self.ms, self.ps, self.first.divisor)


def orthogonalize_(p: torch.Tensor, epsilon: float) -> None:
    """Gram-Schmidt on the columns of the n x r matrix ``p``, in place: each column divided by
    (its norm + ``epsilon``), then removed from the columns after it."""
    for i in range(p.shape[1]):
        column = p[:, i:i + 1]
        column.div_(torch.linalg.vector_norm(column) + epsilon)
        if i + 1 < p.shape[1]:
            later = p[:, i + 1:]
            later.sub_(column @ (column.t() @ later))
