"""Exceptions raised by gradsync.

Every error that concerns a collective names the tensor and the rank where it was raised,
so that a message in a multi-rank log says what went wrong and where.
"""

from __future__ import annotations


class GradsyncError(RuntimeError):
    """Base class of every runtime error raised by gradsync."""


class NotInitializedError(GradsyncError):
    """An operation was called before ``gradsync.init()`` (or after ``gradsync.shutdown()``)."""


class LaunchError(GradsyncError):
    """``gradsync.init()`` found, before ``MPI_Init``, that the launcher and the MPI library mpi4py
    loads cannot work together (one MPI's ``mpiexec`` starting a Python whose mpi4py loads another
    MPI, or a wrong ``srun --mpi`` plugin). The message names the launcher, the MPI library (and the
    file it was loaded from) and the fix; MPI is left uninitialised. See docs/launching.md.
    """


class CollectiveError(GradsyncError):
    """A collective failed: ranks disagreed on it, or it could not be carried out.

    The handle of that collective fails on every rank with the same message; other collectives
    in flight are unaffected.
    """


class ShutdownError(GradsyncError):
    """The background coordinator stopped while this operation was still pending."""


class RankFailureError(GradsyncError):
    """Another rank was lost: its process died or hung (no liveness message within
    ``GRADSYNC_RANK_FAILURE_TIMEOUT_SECONDS``), or its background coordinator failed.

    Every pending and later gradsync operation on every surviving rank fails with it; the first line
    of the message names the lost rank(s). ``lost_ranks`` holds them. MPI cannot finish cleanly with
    a lost peer, so at ``gradsync.shutdown()`` (or interpreter exit) gradsync then calls
    ``MPI_Abort``: the launcher's exit status is non-zero.
    """

    def __init__(self, message: str, lost_ranks: tuple[int, ...] = ()):
        super().__init__(message)
        self.lost_ranks = lost_ranks


class StallError(CollectiveError):
    """Some ranks submitted a collective that others did not, for longer than
    ``GRADSYNC_STALL_SHUTDOWN_TIME_SECONDS``; the message is the stall report (tensor, ranks)."""


class NcclError(GradsyncError):
    """An NCCL call failed. The message names the call, NCCL's error string and its last error text.

    ``call`` is the NCCL function (``"ncclCommInitRank"``) and ``result`` its ``ncclResult_t`` code,
    or None when gradsync refused the call before reaching NCCL.
    """

    def __init__(self, message: str, result: int | None = None, call: str | None = None):
        super().__init__(message)
        self.result = result
        self.call = call


class NcclUnavailableError(ImportError):
    """No usable NCCL library (libnccl.so.2) was found; the message lists every place tried and why
    each failed. An ImportError, like a missing optional module."""
