"""Waiting for the other ranks without taking a core from the training.

A rank that reaches a negotiation exchange first waits there for the others. Inside a blocking MPI
call that wait polls: Open MPI spins unless told to yield (``OMPI_MCA_mpi_yield_when_idle``), MPICH
polls and calls ``sched_yield`` every ``MPIR_CVAR_POLLS_BEFORE_YIELD`` polls. Either way the waiting
thread stays runnable, and on a machine whose cores all compute (every rank's training thread busy
with backward) it takes time from the thread the other ranks are waiting for
(docs/performance-notes.md, facts 1 and 11).

:func:`wait` instead starts the collective nonblocking, tests it for a short spin (the common case:
the others are already there), then sleeps between tests, doubling the sleep up to a cap, so the
core is free for the training thread. It is used for the negotiation exchange only, a few dozen bytes
whose progress needs nothing from this rank but a test: a data collective's bytes move only while a
rank is inside MPI, so those stay blocking (fact 2: a test-and-sleep loop made steps 15-20 % slower).
The policy is the ``wait_policy`` setting, ``mpi`` (the blocking call) by default: on 2 ranks sharing
2 cores ``sleep`` measured no faster under MPICH and slower under Open MPI (docs/configuration.md).
"""

from __future__ import annotations

import time

from mpi4py import MPI

SPIN_SECONDS = 50e-6  # test without sleeping for this long: a peer already there answers within it
FIRST_SLEEP_SECONDS = 20e-6
MAX_SLEEP_SECONDS = 500e-6  # the most a wait adds after the last peer arrives



def allreduce(comm: MPI.Comm, buffer, op: MPI.Op, policy: str) -> None:
    """In-place allreduce of ``buffer`` (a writable buffer, e.g. a 1-d numpy array) over ``comm``
    (same semantics as ``MPI_Allreduce`` with ``MPI_IN_PLACE``), waiting as ``policy`` says:
    ``"mpi"``: the blocking call (the MPI's own wait); ``"sleep"``: ``MPI_Iallreduce`` and
    :func:`wait`.

    Raises:
        mpi4py.MPI.Exception: the MPI call failed (as the blocking call would).
    """
    if policy == "mpi":
        comm.Allreduce(MPI.IN_PLACE, buffer, op=op)
    else:
        wait(comm.Iallreduce(MPI.IN_PLACE, buffer, op=op))


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
