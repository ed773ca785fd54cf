"""Waiting on other ranks by polling, where a blocking MPI call could wait forever or spin a core.

:func:`poll_pause` paces a poll (fast while an answer is likely soon, then slower), :func:`poll_until`
is the loop with a deadline, and :func:`await_ranks` the members' handshake before a collective
communicator set-up. The key-value store (:mod:`.key_value_store`) polls with the same two.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

#: A caller's polling, in seconds: ``(pause, hot, bound)``: every ``pause`` while the wait is under
#: ``hot`` seconds old, then doubling from 1 ms up to ``bound`` (see :func:`poll_pause`).
CALLER_POLL = (0.0001, 0.02, 0.01)
#: The tag of await_ranks's tokens on the user thread's communicator (no other message uses it).
AWAIT_RANKS_TAG = 7301


def poll_pause(since: float, now: float, last: float, poll: tuple[float, float, float]) -> float:
    """The next pause in seconds of a poll that began (or last saw a request) at ``since``, the
    previous pause being ``last``; ``poll`` is ``(pause, hot, bound)`` as :data:`CALLER_POLL`."""
    pause, hot, bound = poll
    if now - since < hot:
        return pause
    return min(max(2 * last, 0.001), bound)


def poll_until(attempt: Callable[[], Any], done: Callable[[Any], bool], timeout: float | None,
               timed_out: Callable[[], Exception], stop: Callable[[], bool] = lambda: False) -> Any:
    """``attempt()`` until ``done`` holds of its result, which is returned, sleeping between
    attempts as :data:`CALLER_POLL` says; raises ``timed_out()`` once ``timeout`` seconds have passed
    (None: never) or ``stop()`` is true."""
    start = time.monotonic()
    pause = CALLER_POLL[0]
    while True:
        result = attempt()
        if done(result):
            return result
        now = time.monotonic()
        left = float("inf") if timeout is None else start + timeout - now
        if left <= 0 or stop():
            raise timed_out()
        pause = poll_pause(start, now, pause, CALLER_POLL)
        time.sleep(min(pause, left))


def await_ranks(comm: Any, rank: int, ranks: list[int], timeout: float | None, what: str) -> None:
    """Return once every other rank of ``ranks`` (ranks of ``comm``, ``rank`` among them) has called
    this too, for ``what``: each sends the others a one-byte token on ``comm`` and waits for theirs,
    polling, so that the collective calls that follow (a communicator made of ``ranks``) never
    wait for a rank that will not come. ``timeout``: seconds (None: no bound).

    Raises:
        TimeoutError: a rank's token did not come within ``timeout``; the message names ``what``,
            this rank and the ranks that did not call. Its token may arrive later, so the ranks'
            next ``await_ranks`` calls no longer pair up: after this error the job should end, as
            after any collective that timed out.
    """
    from mpi4py import MPI

    others = [other for other in ranks if other != rank]
    if not others:
        return
    token = np.zeros(1, np.uint8)
    inbox = np.zeros(len(others), np.uint8)
    sends = [comm.Isend([token, MPI.BYTE], dest=other, tag=AWAIT_RANKS_TAG) for other in others]
    receives = [comm.Irecv([inbox[i:i + 1], MPI.BYTE], source=other, tag=AWAIT_RANKS_TAG)
                for i, other in enumerate(others)]

    def timed_out() -> TimeoutError:
        missing = [other for other, request in zip(others, receives) if not request.Test()]
        for request in receives:
            request.Cancel()
        MPI.Request.Waitall(receives)
        return TimeoutError(f"gradsync: rank {rank}: {what}: rank(s) {missing} did not call it "
                            f"within {timeout:g} s (every rank of {ranks} must)")

    poll_until(lambda: MPI.Request.Testall(receives), bool, timeout, timed_out)
    MPI.Request.Waitall(sends)
