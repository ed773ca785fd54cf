"""Waiting for the other ranks without taking a core from the training.

A rank that reaches a negotiation exchange first waits there for the others. Inside a blocking MPI
call that wait polls: Open MPI spins unless told to yield (``OMPI_MCA_mpi_yield_when_idle``), MPICH
polls and calls ``sched_yield`` every ``MPIR_CVAR_POLLS_BEFORE_YIELD`` polls. Either way the waiting
thread stays runnable, and on a machine whose cores all compute (every rank's training thread busy
with backward) it takes time from the thread the other ranks are waiting for
(docs/performance-notes.md, facts 1 and 11).

:func:`wait` instead tests the exchange's nonblocking allreduce (persistent, or ``MPI_Iallreduce``,
on every rank: :meth:`gradsync.engine.negotiation.Negotiator.cycle`) for a short spin (the common
case: the others are already there), then sleeps between tests, doubling the sleep up to a cap, so
the core is free for the training thread. It is used for the negotiation exchange only, a few dozen
bytes whose progress needs nothing from this rank but a test: a data collective's bytes move only
while a rank is inside MPI, so the background thread completes those with ``MPI_Wait`` (fact 2: a
test-and-sleep loop made steps 15-20 % slower). The policy is the ``wait_policy`` setting, ``mpi``
(``MPI_Wait``, the MPI's own wait) by default: on 2 ranks sharing 2 cores ``sleep`` measured no
faster under MPICH and slower under Open MPI (docs/configuration.md).

:func:`wait_or_leave` is the same loop for a *caller's turn* (:mod:`gradsync.engine.caller_runs`): a
user's thread running the coordinator's cycle must be able to stop waiting, which a thread inside a
blocking MPI call cannot: when its deadline passes (``Handle.wait(timeout)``, a torch group's
timeout) or gradsync stops (the liveness watchdog's verdict on a lost rank). It raises
:class:`LeftTurn` then, with the MPI request still pending; the coordinator keeps the request and
the background thread completes it (:meth:`gradsync.engine.coordinator.Coordinator.cycle`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from mpi4py import MPI

SPIN_SECONDS = 50e-6  # test without sleeping for this long: a peer already there answers within it
CALLER_PATIENCE_SECONDS = 200e-6  # how long a caller's turn spins on a negotiation before it leaves
FIRST_SLEEP_SECONDS = 20e-6
MAX_SLEEP_SECONDS = 500e-6  # the most a wait adds after the last peer arrives


class LeftTurn(BaseException):
    """A caller's turn stopped waiting (:func:`wait_or_leave`): its deadline passed or gradsync
    stopped. A BaseException: nothing between the wait and the caller's turn may take it for an
    error of the collective."""


def wait(request: MPI.Request) -> None:
    """Complete ``request``: test it for up to :data:`SPIN_SECONDS`, then sleep between tests from
    :data:`FIRST_SLEEP_SECONDS`, doubling up to :data:`MAX_SLEEP_SECONDS`. The sleeps release the
    GIL and the core. Returns once the request is complete; never times out (a lost rank is the
    failure detector's business, as for a blocking call).
    """
    test = request.Test
    if test():
        return
    deadline = time.perf_counter() + SPIN_SECONDS
    while time.perf_counter() < deadline:
        if test():
            return
    pause = FIRST_SLEEP_SECONDS
    while not test():
        time.sleep(pause)
        pause = min(2 * pause, MAX_SLEEP_SECONDS)


def wait_or_leave(request: MPI.Request, leave: Callable[[], bool],
                  patience: float | None = None) -> None:
    """Complete ``request`` as :func:`wait` does, but in a caller's turn: ``leave()`` is asked
    between tests (every test while spinning is cheap, so there every 64th), and once it says True
    the wait stops. ``patience``: seconds of spinning after which the wait stops too, instead of
    sleeping (a negotiation whose peers are not there yet: the coordinator thread, which waits
    inside MPI and wakes at once, takes it over; a sleeping caller would wake up to
    :data:`MAX_SLEEP_SECONDS` late).

    Raises:
        LeftTurn: ``leave()`` returned True, or ``patience`` ran out, before the request completed
            (it is still pending: whoever runs the next cycle must complete it).
    """
    test = request.Test
    if test():
        return
    deadline = time.perf_counter() + (SPIN_SECONDS if patience is None else patience)
    spins = 0
    while time.perf_counter() < deadline:
        if test():
            return
        spins += 1
        if not spins & 63 and leave():
            raise LeftTurn
    if patience is not None:
        raise LeftTurn
    pause = FIRST_SLEEP_SECONDS
    while not test():
        if leave():
            raise LeftTurn
        time.sleep(pause)
        pause = min(2 * pause, MAX_SLEEP_SECONDS)
