"""send and recv of the process group, over a communicator of its own.

Point-to-point messages are not in gradsync's engine (it negotiates collectives among every rank of
a set), so a group sends and receives on its own duplicated MPI communicator, matched by source and
tag as MPI matches them (messages of one source and tag arrive in the order sent). The message is
posted at once (MPI_Isend / MPI_Irecv, in the calling thread) and waited for by the group's
point-to-point completion thread, separate from the collectives' one: a pending receive never
holds back the completion of a collective, nor a barrier.

Tensors travel as their raw bytes, CUDA tensors through host copies (sent from a copy made when
``send`` is called; received into host memory and copied into the tensor before the Work
completes): sender and receiver must agree on dtype and size (a larger
message than the receiving tensor fails that receive with MPI's truncation error).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..views import numpy_view
from .movement import host
from .work import Completer, FutureWork


def _bytes(tensor: torch.Tensor) -> Any:
    """A numpy uint8 view of the contiguous ``tensor``'s memory (any dtype, bfloat16 and bool too)."""
    return numpy_view(tensor.reshape(-1).view(torch.uint8))


class PointToPoint:
    """One group's send and recv on ``comm`` (its own communicator, freed by :meth:`close`)."""

    def __init__(self, comm: Any, name: str, timeout: float | None = None) -> None:
        self._comm = comm
        self._completer = Completer(f"{name}-p2p", timeout)

    def send(self, tensors: Sequence[torch.Tensor], dst: int, tag: int) -> FutureWork:
        """Post ``tensors`` to group rank ``dst``; the Work completes once MPI has sent them."""
        from mpi4py import MPI

        buffers = [_bytes(host(tensor).contiguous()) for tensor in tensors]
        requests = [self._comm.Isend([buffer, MPI.BYTE], dest=dst, tag=tag) for buffer in buffers]

        def finish(results: list[Any]) -> list[torch.Tensor]:
            del buffers[:]  # kept alive until MPI is done with them
            return list(tensors)

        return self._completer.work([request.Wait for request in requests], finish,
                                    what=f"send to rank {dst} (tag {tag})")

    def recv(self, tensors: Sequence[torch.Tensor], src: int | None, tag: int) -> FutureWork:
        """Post receives into ``tensors`` from group rank ``src`` (None: any rank); the Work's
        ``_source_rank()`` is the sender once it completed."""
        from mpi4py import MPI

        targets = [tensor if tensor.is_contiguous() and not tensor.is_cuda
                   else torch.empty(tensor.shape, dtype=tensor.dtype) for tensor in tensors]
        statuses = [MPI.Status() for _ in targets]
        source = MPI.ANY_SOURCE if src is None else src
        requests = [self._comm.Irecv([_bytes(target), MPI.BYTE], source=source, tag=tag)
                    for target in targets]
        senders: list[int] = []

        def finish(results: list[Any]) -> list[torch.Tensor]:
            for tensor, target, status in zip(tensors, targets, statuses):
                senders.append(status.Get_source())
                if target is not tensor:
                    tensor.copy_(target)
            return list(tensors)

        waits = [lambda request=request, status=status: request.Wait(status)
                 for request, status in zip(requests, statuses)]
        return self._completer.work(waits, finish, source=lambda: senders[0],
                                    what=f"recv from rank {'any' if src is None else src} (tag {tag})")

    def close(self) -> None:
        """Finish the messages waited for so far, then free the communicator."""
        self._completer.close()
        if self._comm is not None:
            comm, self._comm = self._comm, None
            comm.Free()
