"""Negotiation on the coordinator rank (rank 0): which requests are ready on every rank, in what order.

Every cycle each rank sends rank 0 the requests it has not sent before. Rank 0 keeps a message table
(tensor name -> each rank's request). When the last rank's request for a name arrives, rank 0 checks
that all ranks agree on it and emits a response; ready allreduces are fused (:mod:`gradsync.fusion`).
Rank 0 broadcasts the ordered responses, so every rank executes the same collectives in the same order,
whatever order its own tensors were produced in.
"""

from __future__ import annotations

from collections.abc import Iterable

from . import fusion
from .protocol import CycleReply, Kind, Request, Response

# Fields on which every rank must agree, with the word used in error messages.
_AGREED_FIELDS = (("kind", "collective"), ("dtype", "dtype"), ("op", "op"), ("root", "root rank"),
                  ("prescale", "prescale_factor"), ("postscale", "postscale_factor"))


class MessageTable:
    """Rank 0's record of submitted requests not yet answered."""

    def __init__(self, size: int, fusion_threshold: int) -> None:
        self.size = size
        self.fusion_threshold = fusion_threshold
        self._requests: dict[str, list[Request | None]] = {}

    def cycle(self, gathered: Iterable[tuple[bool, list[Request]]]) -> CycleReply:
        """Take one cycle's messages (one ``(shutdown, new requests)`` per rank, in rank order)."""
        ready: list[str] = []
        shutdown_ranks = []
        for rank, (shutdown, requests) in enumerate(gathered):
            if shutdown:
                shutdown_ranks.append(rank)
            for request in requests:
                slots = self._requests.setdefault(request.name, [None] * self.size)
                slots[rank] = request
                if all(slot is not None for slot in slots):
                    ready.append(request.name)
        return CycleReply(self._responses(ready), tuple(shutdown_ranks))

    def pending(self) -> dict[str, list[int]]:
        """Names still waiting, with the ranks that have submitted them."""
        return {name: [r for r, slot in enumerate(slots) if slot is not None]
                for name, slots in self._requests.items()}

    def _responses(self, ready: list[str]) -> tuple[Response, ...]:
        responses: list[Response] = []
        allreduces: list[Request] = []
        for name in ready:
            requests = self._requests.pop(name)
            error = _disagreement(requests)
            first = requests[0]
            if error is not None:
                responses.append(Response(first.kind, (name,), error=error))
            elif first.kind == Kind.ALLREDUCE:
                allreduces.append(first)
            elif first.kind == Kind.ALLGATHER:
                responses.append(Response(first.kind, (name,),
                                          first_dims=tuple(r.shape[0] for r in requests)))
            else:
                responses.append(Response(first.kind, (name,)))
        responses.extend(fusion.plan_allreduce(allreduces, self.fusion_threshold))
        return tuple(responses)


def _disagreement(requests: list[Request]) -> str | None:
    """An error message if the ranks' requests for one name disagree, else None."""
    first = requests[0]
    kind = first.kind.name.lower()
    for field, word in _AGREED_FIELDS:
        values = [getattr(r, field) for r in requests]
        if any(v != values[0] for v in values):
            return _mismatch(kind, first.name, word, values)
    shapes = [r.shape for r in requests]
    if first.kind == Kind.ALLGATHER:
        trailing = [s[1:] for s in shapes]
        if any(len(s) == 0 for s in shapes) or any(t != trailing[0] for t in trailing):
            return _mismatch(kind, first.name, "shape (all but the first dimension must match)",
                             shapes)
    elif any(s != shapes[0] for s in shapes):
        return _mismatch(kind, first.name, "shape", shapes)
    return None


def _mismatch(kind: str, name: str, word: str, values: list) -> str:
    listed = ", ".join(f"rank {rank}: {_show(v)}" for rank, v in enumerate(values))
    return f"{kind} {name!r}: ranks disagree on {word}: {listed}"


def _show(value) -> str:
    return value.name if hasattr(value, "name") and not isinstance(value, str) else repr(value)
