"""Exceptions raised by gradsync.

Every error that concerns a collective names the tensor and the rank where it was raised,
so that a message in a multi-rank log says what went wrong and where.
"""

from __future__ import annotations


class GradsyncError(RuntimeError):
    """Base class of every runtime error raised by gradsync."""


class NotInitializedError(GradsyncError):
    """An operation was called before ``gradsync.init()`` (or after ``gradsync.shutdown()``)."""


class CollectiveError(GradsyncError):
    """A collective failed: ranks disagreed on it, or it could not be carried out.

    The handle of that collective fails on every rank with the same message; other collectives
    in flight are unaffected.
    """


class ShutdownError(GradsyncError):
    """The background coordinator stopped while this operation was still pending."""
