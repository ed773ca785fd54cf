"""ZeroRedundancyOptimizer's state between shards and the plain optimizer's format.

A rank's wrapped optimizer steps over *shard tensors*: the parameter itself where the rank owns
all of it, else a flat view of the elements it owns (:class:`gradsync.torch.reducer.buckets.Piece`). Its
state (Adam's ``exp_avg``, a momentum buffer) is then shaped like the shard tensor. The plain
optimizer's format keys each parameter's state by its index in the whole optimizer, shaped like
the parameter: :func:`slice_state` cuts a rank's piece out of it, :func:`merge_pieces` puts the
ranks' pieces back together. Scalar state (Adam's ``step``) is the same on every piece and is
taken once.
"""

from __future__ import annotations

import torch

from .reducer.buckets import Piece


def flat(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s elements as a 1-D view without autograd history (it must be contiguous)."""
    return tensor.detach().view(-1)


def shard_tensor(piece: Piece) -> torch.Tensor:
    """The tensor the wrapped optimizer steps for ``piece``: the parameter itself if the piece is
    all of it, else a 1-D view of its elements ``piece.start`` to ``piece.start + piece.numel``."""
    return piece.param if piece.whole else flat(piece.param)[piece.start:piece.start + piece.numel]


def slice_state(state: dict, piece: Piece) -> dict:
    """The state of ``piece`` from the state of its whole parameter: every tensor shaped like the
    parameter is cut to the piece's elements (a copy, flat); anything else (``step``) as is."""
    if piece.whole:
        return state
    shape = piece.param.shape
    return {key: value.reshape(-1)[piece.start:piece.start + piece.numel].clone()
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == shape else value
            for key, value in state.items()}


def merge_pieces(pieces: list[tuple[int, int, dict]], param: torch.Tensor, index: int) -> dict:
    """One parameter's state in the plain optimizer's format from its pieces' states.

    Args:
        pieces: ``(start, numel, state)`` of every rank's piece of ``param`` that has state.
        param: the parameter (its shape and element count).
        index: its index in the whole optimizer, for errors.

    Raises:
        ValueError: the pieces do not cover the parameter's elements exactly once.
    """
    pieces = sorted(pieces, key=lambda piece: piece[0])
    starts = [start for start, _, _ in pieces]
    if starts != [sum(n for _, n, _ in pieces[:i]) for i in range(len(pieces))] or \
            sum(n for _, n, _ in pieces) != param.numel():
        raise ValueError(f"gradsync: the optimizer state of parameter {index} (shape "
                         f"{tuple(param.shape)}) comes in pieces {[(s, n) for s, n, _ in pieces]} "
                         "that do not cover it")
    if len(pieces) == 1:
        return pieces[0][2]
    first = pieces[0][2]
    return {key: torch.cat([state[key] for _, _, state in pieces]).view(param.shape)
            if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == pieces[0][1]
            else value for key, value in first.items()}
