"""Allreduce through shared memory, for ranks that all share one host.

When every rank of a communicator runs on one host, each rank can read and write the others'
memory directly once it lies in memory they all map: one file in ``/dev/shm`` (tmpfs), created by
the first rank, mapped by every rank, and unlinked once all have it (the same as
``MPI_Win_allocate_shared`` gives; a file of our own avoids Open MPI's one-sided components, which
print errors on hosts without UCX). Each rank owns one *segment* of it. A large allreduce then needs
no MPI message: every rank copies the parts of its buffer that the others reduce into its own
segment, and after a barrier each rank reduces one part (its *slice*), reading every rank's
contribution where it lies, and writes the result into its own buffer and into every other rank's
segment; after a second barrier each rank copies the others' results from its own segment. Per
rank that moves about half the bytes of MPI's large-message algorithm (a reduce-scatter and an
allgather: a copy to a temporary, the add from it, and a copy back), measured on the 2-core CI
machine at 2 ranks, nothing else running (docs/benchmarks.md#shared-memory-allreduce-issue-25):

==========================================  ==========  ======================
2.36 MB float32 allreduce, 2 ranks           MPICH       through shared memory
==========================================  ==========  ======================
wall ms / CPU ms of the calling thread       0.99/0.72   0.37/0.26
==========================================  ==========  ======================

Small buffers stay with MPI: below ``GRADSYNC_SHARED_MEMORY_THRESHOLD`` bytes its latency (a few
microseconds) beats the barriers and the numpy calls here.

The barriers are ``MPI_Ibarrier`` on the ranks' ``MPI.COMM_TYPE_SHARED`` communicator, completed by
``MPI_Wait`` (or by a caller's turn that must be able to stop waiting,
:mod:`gradsync.backends.mpi`): it orders memory on every architecture, and it waits in C without
the GIL (0.8 us against MPI_Barrier's 0.4 under Open MPI, 3.3 against 2.5 under MPICH). (A
barrier of counts in the shared
file, waited for with short sleeps so as to leave the core to the training, made the 2-rank MLP
step of benchmarks/train_step.py 10-20 % slower: each wake-up took the GIL from the training
thread's hooks.)

A buffer longer than a segment is reduced in consecutive chunks of the segment's length. Every
slice is reduced by one rank, in rank order (``((x0 + x1) + x2) + ...``), and the same bits are
copied to every rank: every rank gets an identical result, as from MPI_Allreduce.

Whether a reduction takes this path depends only on what every rank agrees on: the shared memory
exists (:func:`open_shared` decides that collectively), and the negotiated dtype, op and length
(:meth:`SharedMemory.takes`). No rank can take the other side of that branch.

Only the thread that runs the backend's collectives calls :meth:`SharedMemory.allreduce` (the
coordinator's rule for its communicators); the barriers' communicator is the backend's own
``MPI.COMM_TYPE_SHARED`` split, used by nothing else.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

from ..engine.protocol import LOGICAL_OPS, ReduceOp

log = logging.getLogger("gradsync")

# The numpy ufunc of each op (bool data, 0/1 as uint8, through protocol.LOGICAL_OPS).
_UFUNCS = {ReduceOp.Sum: np.add, ReduceOp.Min: np.minimum, ReduceOp.Max: np.maximum,
           ReduceOp.Product: np.multiply}
_KINDS = frozenset("biufc")  # numpy dtype kinds the ufuncs reduce as MPI does
SHM_DIRECTORY = "/dev/shm"
PAGE = 4096


def open_shared(comm: MPI.Comm, segment_bytes: int, threshold: int) -> SharedMemory | None:
    """The shared memory of ``comm``'s ranks, or None where the shared-memory path cannot be taken.
    Collective over ``comm``; every rank gets a :class:`SharedMemory` or every rank gets None.

    Args:
        comm: the backend's communicator.
        segment_bytes: bytes of each rank's segment (rounded up to 4 KiB; 0: the path is off). Must
            be the same on every rank (:func:`gradsync.config.check_shared`).
        threshold: the least bytes an allreduce takes this path with.

    None when ``segment_bytes`` is 0 or the settings differ by rank, when ``comm`` has one rank,
    when its ranks are not all on one
    host (the ``MPI.COMM_TYPE_SHARED`` split is smaller than ``comm``), or when some rank could not
    create or map the file (no ``/dev/shm``, or too little room in it: the space is reserved with
    ``posix_fallocate``, so a full tmpfs fails here rather than with SIGBUS later); the reason is
    logged at debug level.
    """
    size = comm.Get_size()
    if size == 1:
        return None
    # Settings that differ by rank: no rank takes the path, and the coordinator's check of the
    # shared settings (gradsync.config.check_shared), next in init(), names every rank's value.
    if len(set(comm.allgather((segment_bytes, threshold)))) > 1 or segment_bytes <= 0:
        return None
    segment_bytes = -(-segment_bytes // PAGE) * PAGE
    local = _one_host(comm)
    if local is None:
        return None
    mapped, path, problem = _create_and_map(local, size * segment_bytes)
    everyone = comm.allreduce(mapped is not None, op=MPI.LAND)
    local.Barrier()  # every rank has mapped it (or failed): the name can go
    if local.Get_rank() == 0 and path is not None:
        os.unlink(path)
    if not everyone:
        log.debug("gradsync: rank %d: shared-memory allreduce off: %s", comm.Get_rank(),
                  problem or "another rank could not map the file")
        if mapped is not None:
            mapped.close()
        local.Free()
        return None
    return SharedMemory(local, mapped, segment_bytes, threshold)


def _one_host(comm: MPI.Comm) -> MPI.Comm | None:
    """``comm``'s ``MPI.COMM_TYPE_SHARED`` split when it holds every rank of ``comm`` (they all run
    on this host), else None; collective over ``comm``."""
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    if comm.allreduce(local.Get_size() == comm.Get_size(), op=MPI.LAND):
        return local
    log.debug("gradsync: shared-memory allreduce off: the ranks are on several hosts")
    local.Free()
    return None


def _create_and_map(local: MPI.Comm, total: int) -> tuple[mmap.mmap | None, str | None, str | None]:
    """Local rank 0 creates a file of ``total`` bytes in /dev/shm, every rank of ``local`` maps it
    (collective over ``local``): (the mapping or None, the file's path or None if it could not be
    created, why this rank has no mapping or None)."""
    mapped, problem, path = None, None, None
    if local.Get_rank() == 0:
        path = os.path.join(SHM_DIRECTORY, f"gradsync-{os.getpid()}-{secrets.token_hex(6)}")
        try:
            _create(path, total)
        except OSError as exc:
            problem, path = f"{path}: {exc}", None
    path = local.bcast(path, root=0)
    if path is not None:
        try:
            mapped = _map(path, total)
        except OSError as exc:
            problem = f"{path}: {exc}"
    return mapped, path, problem


def _create(path: str, nbytes: int) -> None:
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(descriptor, 0, nbytes)
    except OSError:
        os.close(descriptor)
        os.unlink(path)
        raise
    os.close(descriptor)


def _map(path: str, nbytes: int) -> mmap.mmap:
    descriptor = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(descriptor, nbytes)
    finally:
        os.close(descriptor)


class SharedMemory:
    """The shared memory of one communicator whose ranks share a host; see the module docstring.

    Built by :func:`open_shared`. ``segments[r]`` is rank r's segment as bytes, mapped in this
    process.
    """

    def __init__(self, local: MPI.Comm, mapped: mmap.mmap, segment_bytes: int, threshold: int) -> None:
        self.local, self._mapped = local, mapped
        self.rank, self.size = local.Get_rank(), local.Get_size()
        self.segment_bytes, self.threshold = segment_bytes, threshold
        memory = np.frombuffer(mapped, dtype=np.uint8)
        self.segments = [memory[r * segment_bytes:(r + 1) * segment_bytes] for r in range(self.size)]
        self._peers = [r for r in range(self.size) if r != self.rank]

    def takes(self, buffer: np.ndarray, op: ReduceOp) -> bool:
        """Whether an allreduce of ``buffer`` (contiguous, 1-d) with ``op`` runs here. Depends only
        on the negotiated dtype, op and length, so every rank answers alike."""
        return buffer.nbytes >= self.threshold and op in _UFUNCS and buffer.dtype.kind in _KINDS

    def allreduce(self, buffer: np.ndarray, op: ReduceOp, logical: bool = False,
                  scale: float = 1.0, wait: Callable[[MPI.Request], None] | None = None,
                  source: np.ndarray | None = None) -> None:
        """In-place allreduce of the contiguous 1-d ``buffer`` over the ranks; same semantics as
        MPI_Allreduce with MPI_IN_PLACE (``logical``: 0/1 bool data), or with ``source`` as its
        sendbuf (contiguous 1-d, ``buffer``'s dtype and length; read, never written: each rank's
        contribution is read from it and the result written into ``buffer``, with the same
        traffic as in place and no copy of ``source`` first). Only for what :meth:`takes`;
        blocks until every rank has its result. ``scale`` (floating ``buffer`` only): the result
        multiplied by it, as ``np.multiply(result, scale)`` after the allreduce would give, bit for
        bit, but applied by each rank to the slice it reduced while that slice is in its cache,
        before the others copy it (an Average's divisor: no second pass over the buffer).
        ``wait``: completes the barriers, MPI_Ibarrier on every rank (a caller's turn,
        :attr:`gradsync.backends.mpi.MpiBackend.wait`), else MPI_Wait."""
        ufunc = _UFUNCS[LOGICAL_OPS[op] if logical else op]
        chunk = self.segment_bytes // buffer.dtype.itemsize
        ibarrier = self.local.Ibarrier
        barrier = (lambda: ibarrier().Wait()) if wait is None else (lambda: wait(ibarrier()))
        source = buffer if source is None else source
        for start in range(0, buffer.shape[0], chunk):
            self._reduce_chunk(buffer[start:start + chunk], ufunc, scale, barrier,
                               source[start:start + chunk])

    def _reduce_chunk(self, data: np.ndarray, ufunc: np.ufunc, scale: float,
                      barrier: Callable[[], None], source: np.ndarray) -> None:
        """One chunk: this rank's contribution read from ``source`` (``data`` itself in place),
        the result written into ``data``."""
        count, rank, size = data.shape[0], self.rank, self.size
        bounds = [count * r // size for r in range(size + 1)]
        segments = [s[:data.nbytes].view(data.dtype) for s in self.segments]
        mine = segments[rank]
        for r in self._peers:  # what the others reduce, where they read it
            mine[bounds[r]:bounds[r + 1]] = source[bounds[r]:bounds[r + 1]]
        barrier()
        lo, hi = bounds[rank], bounds[rank + 1]
        terms = [source[lo:hi] if r == rank else segments[r][lo:hi] for r in range(size)]
        if size == 2:  # one op, straight into the result (x0 + x1 == x1 + x0, bit for bit)
            ufunc(terms[0], terms[1], out=data[lo:hi])
        else:  # in rank order, in this rank's own (otherwise unused) part of its segment
            result = mine[lo:hi]
            ufunc(terms[0], terms[1], out=result)
            for term in terms[2:]:
                ufunc(result, term, out=result)
            data[lo:hi] = result
        if scale != 1.0:  # as HostMemory.copy scales a result in its own buffer
            np.multiply(data[lo:hi], scale, out=data[lo:hi], casting="unsafe")
        for r in self._peers:
            segments[r][lo:hi] = data[lo:hi]
        barrier()
        for r in self._peers:  # the others' results, which they wrote into this rank's segment
            data[bounds[r]:bounds[r + 1]] = mine[bounds[r]:bounds[r + 1]]

    def close(self) -> None:
        """Unmap the memory and free the communicator (collective over the ranks)."""
        self.segments = []
        self.local.Free()
        try:
            self._mapped.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with the process
            pass
