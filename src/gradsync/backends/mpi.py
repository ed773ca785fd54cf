"""The MPI backend: collectives on host (numpy) buffers over the coordinator's own communicators.

Only the thread running the coordinator's cycle calls it. Every call is a blocking MPI collective;
mpi4py releases the GIL while it waits, so the training thread keeps running
(docs/performance-notes.md, facts 1 and 2). The exception is a user's thread running a cycle in its
turn (:mod:`gradsync.engine.caller_runs`), which must be able to stop waiting once gradsync stops
(a lost rank). So a flat allreduce of at most :data:`NONBLOCKING_BYTES` is an ``MPI_Iallreduce``, and
the shared-memory path's barriers are ``MPI_Ibarrier``, on every rank whichever thread runs them (a
nonblocking collective matches only its nonblocking form on the other ranks, and which form a rank
uses depends only on the negotiated length): the background thread completes them with
``MPI_Wait``, a caller's turn through :attr:`MpiBackend.wait`. Measured on 2 ranks, 4 KiB: MPICH
4.6 us blocking against 5.7 us nonblocking, Open MPI 1.8 against 7.3 (64 KiB: 22 / 23 and 18 / 30),
next to some 50 us of the engine's own cost per collective.

Allreduce is flat (one ``MPI_Allreduce`` over all ranks) or, given the host topology, hierarchical:
reduce onto local rank 0 over shared memory, allreduce among the hosts' local rank 0 processes over
the network, broadcast back within each host. Both give the same result; the hierarchical one sends
one buffer per host across the network instead of one per rank.

Large counts: an MPI call takes at most ``2**31 - 1`` elements (a C int count) and int
displacements. Open MPI 5 refuses more with ``MPI_ERR_ARG`` even where mpi4py could pass a large
count (MPICH takes them), so every call is split where a count or a displacement would exceed
:attr:`MpiBackend.max_count`: allreduce and broadcast in chunks, allgather as one chunked broadcast
per rank, reducescatter as one chunked reduce per rank, alltoall as chunked point-to-point messages.
Every rank splits alike: the decision depends only on the negotiated counts.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from mpi4py import MPI

from ..engine.protocol import LOGICAL_OPS, ReduceOp
from ..executors.plan import Traits
from .shared import SharedMemory

#: The most bytes of a flat allreduce that runs as MPI_Iallreduce (see the module docstring).
NONBLOCKING_BYTES = 64 << 10

_MPI_OPS = {
    ReduceOp.Average: MPI.SUM,
    ReduceOp.Sum: MPI.SUM,
    ReduceOp.Min: MPI.MIN,
    ReduceOp.Max: MPI.MAX,
    ReduceOp.Product: MPI.PROD,
}


class MpiBackend:
    """Blocking collectives on contiguous numpy buffers, same semantics as the MPI calls they wrap.

    Args:
        comm: the communicator of all ranks (broadcast, allgather, flat allreduce).
        local: the ranks on this host (an ``MPI.COMM_TYPE_SHARED`` split of ``comm``, local rank 0
            first). Given, allreduce is hierarchical.
        cross: on local rank 0 only, the local rank 0 processes of all hosts; None elsewhere.
        shared: the shared memory of ``comm``'s ranks (:func:`gradsync.backends.shared.open_shared`),
            through which a flat allreduce that it :meth:`~gradsync.backends.shared.SharedMemory.takes`
            runs instead of MPI_Allreduce.

    The backend owns ``local``, ``cross`` and ``shared`` (``close()`` frees them); ``comm`` stays
    the caller's.
    """

    #: What MPI reduces natively (everything but the 16-bit floats; Average is a Sum, divided
    #: after); its allreduce takes a separate source (read in place by the shared-memory path).
    traits = Traits(reduces_from_source=True)
    #: The most elements (of the call's datatype) one MPI call moves, and the largest displacement.
    max_count = 2**31 - 1

    def __init__(self, comm: MPI.Comm, local: MPI.Comm | None = None,
                 cross: MPI.Comm | None = None, shared: SharedMemory | None = None) -> None:
        self.comm = comm
        self.shared = shared
        self.local = local
        self.cross = cross
        self._local_root = local is not None and local.Get_rank() == 0
        if self._local_root and cross is None:
            raise ValueError("MpiBackend: local rank 0 needs the cross communicator")
        #: Set by a caller's turn around the collectives it runs (None: MPI_Wait): completes a
        #: nonblocking request, or raises to leave the turn (gradsync.engine.waiting.wait_or_leave).
        self.wait: Callable[[MPI.Request], None] | None = None
        # Sizes read once here, so that describe() never calls MPI from another thread.
        self._local_size = local.Get_size() if local is not None else 1
        self._cross_size = cross.Get_size() if cross is not None else None

    @property
    def hierarchical(self) -> bool:
        return self.local is not None

    def describe(self) -> str:
        """How allreduce moves data, in words (for logs and ``python -m gradsync.check``)."""
        if not self.hierarchical:
            if self.shared is not None:
                return (f"flat (through shared memory from {self.shared.threshold} bytes, "
                        "else one MPI_Allreduce over all ranks)")
            return "flat (one MPI_Allreduce over all ranks)"
        return (f"hierarchical (reduce within the host, {self._local_size} ranks here; allreduce "
                "among the hosts' local rank 0 processes; broadcast within the host)")

    def scales_in_allreduce(self, buffer: np.ndarray, op: ReduceOp) -> bool:
        """Whether :meth:`allreduce` of ``buffer`` with ``op`` takes a ``scale`` (the shared-memory
        path, floating data): decided by the negotiated dtype, op and length, alike on every rank."""
        return (self.shared is not None and buffer.dtype.kind == "f"
                and self.shared.takes(buffer, op))

    def waits_nonblocking(self, nbytes: int, op: ReduceOp) -> bool:
        """Whether an allreduce of a buffer of ``nbytes`` with ``op`` waits only through
        :attr:`wait` (flat, at most :data:`NONBLOCKING_BYTES`); hierarchical ones block."""
        return self.local is None and op in _MPI_OPS and nbytes <= NONBLOCKING_BYTES

    def allreduce(self, buffer: np.ndarray, op: ReduceOp, logical: bool = False,
                  scale: float = 1.0, source: np.ndarray | None = None) -> None:
        """Allreduce into the contiguous 1-d ``buffer``, in place (same semantics as MPI_Allreduce
        with MPI_IN_PLACE), or of ``source`` (contiguous 1-d, ``buffer``'s dtype and length, left
        unchanged, as MPI_Allreduce's sendbuf); ``logical`` for 0/1 bool data. Split into chunks
        of at most :attr:`max_count` elements. Through shared memory where it takes the buffer
        (the same result, every rank identical: :mod:`gradsync.backends.shared`), which reads
        ``source`` where it lies; MPI itself always gets MPI_IN_PLACE (``source`` copied into
        ``buffer`` first): MPI defines the in-place form only when every rank passes it, and
        whether a rank has a source depends on its own tensor's layout. ``scale``: the result
        multiplied by it, only where :meth:`scales_in_allreduce` (else ValueError)."""
        shared = self.shared is not None and self.shared.takes(buffer, op)
        if scale != 1.0 and not (shared and buffer.dtype.kind == "f"):  # scales_in_allreduce
            raise ValueError(f"MpiBackend.allreduce: scale={scale} on a path that does not scale "
                             f"({buffer.dtype}, {op.name}, {buffer.nbytes} bytes)")
        if shared:
            self.shared.allreduce(buffer, op, logical, scale, self.wait, source)
            return
        if source is not None:  # MPI_IN_PLACE on every rank: whether a rank has a separate source
            np.copyto(buffer, source)  # depends on its own tensor's layout, MPI's in-place form on all
        mpi_op = _MPI_OPS[LOGICAL_OPS[op] if logical else op]
        for chunk in self._chunks(buffer):
            if self.local is None:
                if chunk.nbytes <= NONBLOCKING_BYTES:  # the same form on every rank (module doc)
                    request = self.comm.Iallreduce(MPI.IN_PLACE, chunk, op=mpi_op)
                    request.Wait() if self.wait is None else self.wait(request)
                    continue
                self.comm.Allreduce(MPI.IN_PLACE, chunk, op=mpi_op)
            else:
                self._hierarchical_allreduce(chunk, mpi_op)

    def _chunks(self, buffer: np.ndarray) -> list[np.ndarray]:
        """``buffer`` (1-d) as consecutive views of at most :attr:`max_count` elements (one, empty,
        for an empty buffer)."""
        size = buffer.shape[0]
        if size <= self.max_count:  # the common case (every op runs this): no range, no slice
            return [buffer]
        return [buffer[i:i + self.max_count] for i in range(0, max(size, 1), self.max_count)]

    def _hierarchical_allreduce(self, buffer: np.ndarray, mpi_op: MPI.Op) -> None:
        if self._local_size > 1:
            if self._local_root:
                self.local.Reduce(MPI.IN_PLACE, buffer, op=mpi_op, root=0)
            else:
                self.local.Reduce(buffer, None, op=mpi_op, root=0)
        if self._local_root and self._cross_size > 1:
            self.cross.Allreduce(MPI.IN_PLACE, buffer, op=mpi_op)
        if self._local_size > 1:
            self.local.Bcast(buffer, root=0)

    def broadcast(self, buffer: np.ndarray, root: int) -> None:
        """In-place MPI_Bcast of the contiguous ``buffer``'s bytes from ``root`` (chunked)."""
        for chunk in self._chunks(_bytes(buffer)):
            self.comm.Bcast(chunk, root=root)

    def allgather(self, send: np.ndarray, recv: np.ndarray, counts: list[int]) -> None:
        """MPI_Allgatherv of bytes: rank r contributes ``counts[r]`` bytes; ``recv`` holds them all,
        in rank order. Past :attr:`max_count` bytes in all: one (chunked) broadcast per rank."""
        send, recv = _bytes(send), _bytes(recv)
        starts = _displacements(counts)
        if sum(counts) <= self.max_count:
            self.comm.Allgatherv(send, [recv, (counts, starts), MPI.BYTE])
            return
        rank = self.comm.Get_rank()
        recv[starts[rank]:starts[rank] + counts[rank]] = send
        for root, (start, count) in enumerate(zip(starts, counts)):
            self.broadcast(recv[start:start + count], root)

    def reducescatter(self, send: np.ndarray, receive: np.ndarray, counts: list[int], op: ReduceOp,
                      logical: bool = False) -> None:
        """MPI_Reduce_scatter of the contiguous ``send`` buffer: rank r receives the reduction of
        elements ``sum(counts[:r])`` .. ``sum(counts[:r+1])`` into ``receive`` (``counts[r]``
        elements); ``logical`` for 0/1 bool data. Always over all ranks (never hierarchical).
        Past :attr:`max_count` elements in all: one (chunked) MPI_Reduce onto each rank."""
        mpi_op = _MPI_OPS[LOGICAL_OPS[op] if logical else op]
        if sum(counts) <= self.max_count:
            self.comm.Reduce_scatter(send, receive, counts, op=mpi_op)
            return
        rank = self.comm.Get_rank()
        for root, (start, count) in enumerate(zip(_displacements(counts), counts)):
            for offset in range(0, count, self.max_count):
                part = slice(start + offset, start + min(offset + self.max_count, count))
                into = receive[offset:offset + part.stop - part.start] if root == rank else None
                self.comm.Reduce(send[part], into, op=mpi_op, root=root)

    def alltoall(self, send: np.ndarray, receive: np.ndarray, send_counts: list[int],
                 receive_counts: list[int]) -> None:
        """MPI_Alltoallv of bytes: ``send_counts[r]`` bytes of ``send`` go to rank r, in rank order;
        ``receive`` gets ``receive_counts[r]`` bytes from each rank r, in rank order. Past
        :attr:`max_count` bytes in all: point-to-point messages of at most that many bytes."""
        send, receive = _bytes(send), _bytes(receive)
        if max(sum(send_counts), sum(receive_counts)) <= self.max_count:
            self.comm.Alltoallv([send, (send_counts, _displacements(send_counts)), MPI.BYTE],
                                [receive, (receive_counts, _displacements(receive_counts)), MPI.BYTE])
            return
        size = self.comm.Get_size()
        sent, got = _displacements(send_counts), _displacements(receive_counts)
        requests = []  # one message per chunk: both sides count the chunks of a message alike
        for peer in range(size):
            part = receive[got[peer]:got[peer] + receive_counts[peer]]
            requests += [self.comm.Irecv(c, source=peer, tag=i) for i, c in enumerate(self._chunks(part))]
        for peer in range(size):
            part = send[sent[peer]:sent[peer] + send_counts[peer]]
            requests += [self.comm.Isend(c, dest=peer, tag=i) for i, c in enumerate(self._chunks(part))]
        MPI.Request.Waitall(requests)

    def sendrecv(self, send: np.ndarray, receive: np.ndarray, partner: int) -> None:
        """MPI_Sendrecv with rank ``partner``: ``send`` goes to it while its message of the same
        length arrives in ``receive`` (both contiguous 1-d, one dtype; chunked as :meth:`allreduce`).
        Adasum's pairwise levels (:func:`gradsync.executors.adasum.reduce`)."""
        for i, (out, into) in enumerate(zip(self._chunks(send), self._chunks(receive))):
            self.comm.Sendrecv(out, dest=partner, sendtag=i, recvbuf=into, source=partner, recvtag=i)

    def close(self) -> None:
        """Free the topology communicators this backend owns (after the coordinator stopped)."""
        for comm in (self.local, self.cross):
            if comm is not None:
                comm.Free()
        if self.shared is not None:
            self.shared.close()
        self.local = self.cross = self.shared = None


def _bytes(buffer: np.ndarray) -> np.ndarray:
    """The contiguous ``buffer``'s memory as 1-d bytes."""
    return buffer.reshape(-1).view(np.uint8)


def _displacements(counts: list[int]) -> list[int]:
    """Where each rank's part starts in a buffer of parts of ``counts`` in rank order."""
    return np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64).tolist()
